"""Functions and globals for tests/test_buildsource.py: build functions as a notebook would hold them
(their source is found by inspect), and the globals they read."""

from sentence_transformers import SentenceTransformer as SentenceTransformerModel
from sentence_transformers.sentence_transformer import losses

SIZE = 3
TEXT = "hello"
TABLE = {"k": [1, 2.5, None, "s", b"x", (1, 2), {4}, True, 1j], 7: ("t",)}
MNRL = losses.MultipleNegativesRankingLoss


def _nest(levels):
    x = 0
    for _ in range(levels):
        x = [x]
    return x


DEEP_20 = _nest(20)  # the number at depth 20: still a literal
DEEP_21 = _nest(21)  # one level more: refused
OBJECT_IN_A_LIST = [1, object()]
OBJECT_AS_VALUE = {"a": object()}
OBJECT_AS_KEY = {object(): 1}


class Outer:
    class Inner:
        pass


Inner = Outer.Inner


def tag(f):  # a decorator that changes nothing, but the def statement carries it
    return f


def reads_body_and_comprehension():
    squares = [SIZE * i for i in range(4)]  # SIZE read in the comprehension's own code
    return squares, TEXT


def with_defaults(a=SIZE, *, b=TEXT, c):  # a keyword-only argument without a default, too
    return a, b, c


def reads_literal_table():
    return TABLE


def reads_deep_20():
    return DEEP_20


def reads_deep_21():
    return DEEP_21


def reads_object_in_a_list():
    return OBJECT_IN_A_LIST


def reads_object_as_value():
    return OBJECT_AS_VALUE


def reads_object_as_key():
    return OBJECT_AS_KEY


def reads_nested_class():
    return Inner


def reads_a_loss_class():
    return MNRL


def notebook_helper():
    return SIZE + 1


def reads_notebook_helper():
    return notebook_helper()


@tag
def decorated_build():
    return None


def build(n=2):  # named like the script's entry point: the partial gets another name
    return n


def takes_one(n):
    return n


class Flag(int):  # an int subclass: its repr reads back as a plain int, equal but not the same type
    pass


FLAG_AS_VALUE = {"a": Flag(3)}
FLAG_AS_KEY = {Flag(3): "a"}
FLAGS_IN_A_LIST = [Flag(3)]


def reads_flag_as_value():
    return FLAG_AS_VALUE


def reads_flag_as_key():
    return FLAG_AS_KEY


def reads_flags_in_a_list():
    return FLAGS_IN_A_LIST


def reads_a_top_level_class():
    return SentenceTransformerModel


import email.mime  # noqa: E402
import json  # noqa: E402
import json as js  # noqa: E402
import types as _types  # noqa: E402

from email import mime  # noqa: E402
import email.mime as em  # noqa: E402

MADE_HERE = _types.ModuleType("made_here")  # a module object that no import can give back
ORDERED = {"b": 1, "a": 2}
LONG = list(range(40))
AT_LIMIT = "x" * (200_000 - 2)  # repr adds the two quotes: exactly LITERAL_MAX_CHARS characters
OVER_LIMIT = "x" * 200_000


def reads_modules():
    return json, js, mime, em


def reads_made_here():
    return MADE_HERE


def reads_ordered_and_long():
    return ORDERED, LONG


def reads_at_limit():
    return AT_LIMIT


def reads_over_limit():
    return OVER_LIMIT


def countdown(n):  # calls itself: its source goes in once
    return n if n <= 0 else countdown(n - 1)


class CellClass:  # made to look defined in a notebook cell by the tests (__module__ = "__main__")
    pass


def reads_cell_class():
    return CellClass


def reads_alias():
    return alias_of_helper()


alias_of_helper = notebook_helper


# ---- more shapes for test_buildsource ----------------------------------------------------------

@tag
@tag
def decorated_twice():
    return None


from collections import OrderedDict  # noqa: E402  a class imported under its own name
from xml.etree import ElementTree  # noqa: E402  a module three names deep, by its last name


def reads_deep_module_and_a_class_by_its_own_name():
    return ElementTree, OrderedDict


def _tuples(levels):
    x = 0
    for _ in range(levels):
        x = (x,)
    return x


KEY_AT_LIMIT = {_tuples(19): 1}   # the dict is depth 0, its key 1: the key's number is at depth 20
KEY_TOO_DEEP = {_tuples(20): 1}
VALUE_AT_LIMIT = {"k": _nest(19)}
VALUE_TOO_DEEP = {"k": _nest(20)}
NOT_A_NUMBER = float("nan")  # repr 'nan' is no literal: it cannot be written into a script


def reads_key_at_limit():
    return KEY_AT_LIMIT


def reads_key_too_deep():
    return KEY_TOO_DEEP


def reads_value_at_limit():
    return VALUE_AT_LIMIT


def reads_value_too_deep():
    return VALUE_TOO_DEEP


def reads_not_a_number():
    return NOT_A_NUMBER


AT_110 = list(range(30))        # repr: exactly 110 characters, one line
OVER_110 = list(range(1, 31))   # repr: 111 characters, wrapped


def reads_at_and_over_110():
    return AT_110, OVER_110


def shared_helper():  # called by left and right: its source goes in once
    return SIZE * 2


def left():
    return shared_helper() + SIZE


def right():
    return shared_helper()


def reads_left_and_right():
    return left(), right()


def calls_build(n):  # reads the global `build`, the name a partial's entry point takes
    return build, n


def main():  # the exported script's own entry point's name
    return SIZE


STNB_OPTIONS = {"strategy": "ddp"}


def reads_reserved_names():
    return STNB_OPTIONS, main()


def reads_two_kernel_objects():
    return OBJECT_AS_VALUE, OBJECT_IN_A_LIST


def reads_undefined_names():
    return NOT_DEFINED_B, NOT_DEFINED_A  # noqa: F821


class Builder:  # a callable object: not a function a script can define
    def __call__(self, *args):
        return args

    def __repr__(self):
        return "Builder()"


class LongRepr:
    def __repr__(self):
        return "<" + "L" * 70 + ">"


def imports_inside():
    from json import dumps, loads

    def inner():
        from os import sep
        return sep

    return dumps, loads, inner, len, SIZE, NOT_DEFINED_C  # noqa: F821


from buildsource_other import calls_other_helper  # noqa: E402  reads another shared_helper


def reads_two_helpers_named_alike():
    return shared_helper(), calls_other_helper()


def reads_a_package_it_imports():
    """Reads what a package's submodules hold, imported in its body (``buildsource_pkg`` is not imported at
    the top of this file: ``read_objects`` must import it)."""
    from buildsource_pkg import sub
    from buildsource_pkg.deep import Other

    return sub.Thing(), sub.KIND, Other
