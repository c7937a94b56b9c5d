"""stnb.buildsource.build_source: what a build function needs goes into the script (imports, literals,
helper functions), found wherever the function reads it; what exists only in the kernel is refused,
named. Fast: nothing runs but the source analysis (the exported script is run in test_export_build)."""

from __future__ import annotations

import ast
import linecache
import sys

import pytest

import buildsource_helpers as h
from stnb.buildsource import build_source
from stnb.errors import ConfigError


def _refusal(fn) -> str:
    """The message ``build_source(fn)`` refuses ``fn`` with (a ConfigError, or the test fails)."""
    with pytest.raises(ConfigError) as e:
        build_source(fn)
    return str(e.value)


def _script_names(text) -> dict:
    """{name: literal value} of the script's top-level literal assignments."""
    out = {}
    for n in ast.parse(text).body:
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name):
            try:
                out[n.targets[0].id] = ast.literal_eval(n.value)
            except ValueError:
                pass
    return out


def test_globals_read_in_the_body_and_in_a_comprehension_both_go_along():
    src = build_source(h.reads_body_and_comprehension)
    assert _script_names(src.text) == {"SIZE": 3, "TEXT": "hello"}
    assert src.name == "reads_body_and_comprehension" and src.functions == ["reads_body_and_comprehension"]


def test_globals_read_by_default_values_go_along():
    assert _script_names(build_source(h.with_defaults).text) == {"SIZE": 3, "TEXT": "hello"}


def test_containers_of_literals_are_copied_and_read_back_equal():
    assert _script_names(build_source(h.reads_literal_table).text)["TABLE"] == h.TABLE
    assert _script_names(build_source(h.reads_deep_20).text)["DEEP_20"] == h.DEEP_20


@pytest.mark.parametrize("fn, name", [(h.reads_deep_21, "DEEP_21"), (h.reads_object_in_a_list, "OBJECT_IN_A_LIST"),
                                      (h.reads_object_as_value, "OBJECT_AS_VALUE"),
                                      (h.reads_object_as_key, "OBJECT_AS_KEY"),
                                      # an int subclass reads back equal as a plain int: still not a literal
                                      (h.reads_flag_as_value, "FLAG_AS_VALUE"), (h.reads_flag_as_key, "FLAG_AS_KEY"),
                                      (h.reads_flags_in_a_list, "FLAGS_IN_A_LIST")])
def test_containers_holding_objects_or_nested_too_deep_are_refused(fn, name):
    kind = type(getattr(h, name))
    with pytest.raises(ConfigError, match=rf"reads global\(s\) that exist only in this kernel: {name} \(a "
                                          rf"builtins\.{kind.__name__} object built in the notebook\)"):
        build_source(fn)


def test_a_class_is_imported_from_the_shortest_module_that_exports_it():
    src = build_source(h.reads_a_loss_class)
    assert src.imports == ["from sentence_transformers.sentence_transformer.losses import "
                           "MultipleNegativesRankingLoss as MNRL"]


def test_a_class_exported_by_the_top_package_is_imported_from_it():
    assert build_source(h.reads_a_top_level_class).imports == [
        "from sentence_transformers import SentenceTransformer as SentenceTransformerModel"]


def test_a_nested_class_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"Inner \(buildsource_helpers\.Outer\.Inner: nested; import it at the "
                                          r"top level of a module\)"):
        build_source(h.reads_nested_class)


def test_a_helper_defined_in_the_notebook_goes_along_as_source(monkeypatch):
    """In a kernel, cell functions live in __main__: their source is copied, never imported from __main__."""
    monkeypatch.setattr(h.notebook_helper, "__module__", "__main__")
    monkeypatch.setattr(sys.modules["__main__"], "notebook_helper", h.notebook_helper, raising=False)
    src = build_source(h.reads_notebook_helper)
    assert src.functions == ["notebook_helper", "reads_notebook_helper"]  # defined before it is called
    assert not any("__main__" in line for line in src.imports)
    assert "def notebook_helper():" in src.text and _script_names(src.text) == {"SIZE": 3}


def test_a_decorated_function_is_refused_naming_the_decorator():
    assert _refusal(h.decorated_build) == (
        "decorated_build() is decorated (tag); export a plain function and apply the "
        "decorator's effect inside it")


def _with_source_lines(name, lines):
    """A function whose source, as inspect finds it, is ``lines`` (getsource found the wrong lines)."""
    filename = f"<stnb-test-{name}>"
    ns = {}
    exec(compile(f"def {name}():\n    return 1\n", filename, "exec"), ns)
    linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    return ns[name]


@pytest.mark.parametrize("lines", [["x = 1\n"], ["def other():\n", "    return 2\n"]])
def test_source_that_is_not_the_def_statement_is_refused(lines):
    fn = _with_source_lines("wrong_lines", lines)
    assert _refusal(fn) == ("the source found for wrong_lines() is not its def statement; define it with def "
                            "in a cell")


def test_source_that_does_not_parse_is_refused():
    fn = _with_source_lines("broken", ["def broken():\n", "    return 1 1\n"])
    with pytest.raises(ConfigError, match=r"^the source found for broken\(\) does not parse \(.+\); define it with "
                                          r"def in a cell$"):
        build_source(fn)


def test_a_partial_is_exported_as_a_call_of_the_function_with_its_literal_arguments():
    import functools

    src = build_source(functools.partial(h.takes_one, n={"k": [1, "a"]}))
    assert src.name == "build" and src.imports == ["import functools"]
    assert src.text.endswith("\n\n\nbuild = functools.partial(takes_one, n={'k': [1, 'a']})\n")
    assert src.literals == [] and src.functions == ["takes_one"]
    own = build_source(functools.partial(h.build, 3))
    assert own.name == "build_partial" and own.text.endswith("build_partial = functools.partial(build, 3)\n")
    # the parts are separated by two blank lines, each without blank lines at its ends
    assert "\n\n\n\n" not in src.text and src.text.startswith("import functools\n\n\ndef takes_one(n):")


def test_a_partial_binding_an_object_is_refused():
    import functools

    assert _refusal(functools.partial(h.takes_one, n=h.OBJECT_AS_VALUE)) == (
        f"the functools.partial of takes_one binds {repr(h.OBJECT_AS_VALUE)[:60]}, which exist "
        "only in this kernel; bind only numbers, strings, lists and dicts of them, or build "
        "those objects inside the function")


def test_a_script_holds_literals_and_functions_in_order():
    src = build_source(h.reads_body_and_comprehension)
    assert src.literals == ["SIZE = 3", "TEXT = 'hello'"]
    assert src.text == ("SIZE = 3\nTEXT = 'hello'\n\n\n" + _source_of(h.reads_body_and_comprehension))


def _source_of(fn):
    import inspect

    return inspect.getsource(fn).rstrip() + "\n"


def test_modules_are_imported_as_the_function_names_them():
    assert build_source(h.reads_modules).imports == ["import email.mime as em", "import json", "import json as js",
                                                     "from email import mime"]


def test_a_module_no_import_gives_back_is_refused():
    with pytest.raises(ConfigError, match=r"MADE_HERE \(module 'made_here', not importable\)"):
        build_source(h.reads_made_here)


def test_literals_keep_their_order_and_wrap_at_110_columns():
    import pprint

    src = build_source(h.reads_ordered_and_long)
    assert src.literals == [f"LONG = {pprint.pformat(h.LONG, width=110)}", "ORDERED = {'b': 1, 'a': 2}"]
    assert max(len(line) for line in src.literals[0].splitlines()) <= 110 < len(repr(h.LONG))


def test_a_literal_up_to_the_limit_is_copied_and_a_longer_one_refused():
    assert len(build_source(h.reads_at_limit).literals[0]) == len("AT_LIMIT = ") + 200_000
    with pytest.raises(ConfigError, match=r"OVER_LIMIT \(a str of 200,002 characters: too large to copy into a "
                                          r"script\)"):
        build_source(h.reads_over_limit)


def test_a_recursive_function_goes_in_once():
    src = build_source(h.countdown)
    assert src.functions == ["countdown"] and src.text.count("def countdown(") == 1


def test_a_class_defined_in_a_cell_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(h.CellClass, "__module__", "__main__")
    with pytest.raises(ConfigError, match=r"CellClass \(defined in a cell; move it to a \.py module and import it\)"):
        build_source(h.reads_cell_class)


def test_a_notebook_function_under_another_name_is_refused(monkeypatch):
    monkeypatch.setattr(h.notebook_helper, "__module__", "__main__")
    with pytest.raises(ConfigError, match=r"alias_of_helper \(the function notebook_helper under another name; "
                                          r"call it by its own name\)"):
        build_source(h.reads_alias)


# ---- the words of each refusal, and the script's parts --------------------------------------------------

def test_every_decorator_is_named():
    assert _refusal(h.decorated_twice).startswith("decorated_twice() is decorated (tag, tag); ")


def test_a_module_deep_in_a_package_and_a_class_under_its_own_name_are_imported_as_written():
    assert build_source(h.reads_deep_module_and_a_class_by_its_own_name).imports == [
        "from collections import OrderedDict", "from xml.etree import ElementTree"]


@pytest.mark.parametrize("fn, name", [(h.reads_key_at_limit, "KEY_AT_LIMIT"),
                                      (h.reads_value_at_limit, "VALUE_AT_LIMIT")])
def test_dict_keys_and_values_nested_up_to_the_limit_are_literals(fn, name):
    assert _script_names(build_source(fn).text)[name] == getattr(h, name)


@pytest.mark.parametrize("fn, name", [(h.reads_key_too_deep, "KEY_TOO_DEEP"), (h.reads_value_too_deep, "VALUE_TOO_DEEP"),
                                      (h.reads_not_a_number, "NOT_A_NUMBER")])
def test_dict_keys_and_values_nested_too_deep_and_a_nan_are_refused(fn, name):
    kind = type(getattr(h, name)).__name__
    with pytest.raises(ConfigError, match=rf"exist only in this kernel: {name} \(a builtins\.{kind} object built in "
                                          r"the notebook\)"):
        build_source(fn)


def test_a_literal_of_110_characters_stays_on_one_line_and_one_more_wraps():
    at, over = build_source(h.reads_at_and_over_110).literals
    assert at == "AT_110 = [" + ", ".join(str(i) for i in range(30)) + "]"
    assert over == "OVER_110 = [" + ",\n ".join(str(i) for i in range(1, 31)) + "]"


def test_a_helper_two_functions_call_goes_in_once_with_the_literal_both_read(monkeypatch):
    for fn in (h.shared_helper, h.left, h.right):
        monkeypatch.setattr(fn, "__module__", "__main__")  # defined in the notebook: copied as source
    src = build_source(h.reads_left_and_right)
    assert src.functions == ["shared_helper", "left", "right", "reads_left_and_right"]
    assert src.literals == ["SIZE = 3"]
    assert src.text.count("def shared_helper():") == 1 and src.text.count("SIZE = 3") == 1


@pytest.mark.parametrize("kind", ["import", "function", "module", "literal"])
def test_a_global_named_like_the_partials_entry_point_is_refused_naming_both(monkeypatch, kind):
    import functools
    import json

    if kind == "function":
        monkeypatch.setattr(h.build, "__module__", "__main__")
    elif kind == "module":
        monkeypatch.setattr(h, "build", json)
    elif kind == "literal":
        monkeypatch.setattr(h, "build", 3)
    assert _refusal(functools.partial(h.calls_build, 1)) == (
        f"two different objects are named 'build' in the functions exported ({kind} and "
        "partial); rename one of them")


def test_the_scripts_own_names_are_refused_for_a_function_and_for_globals():
    assert _refusal(h.main) == (
        "the exported script uses the name(s) ['main'] itself; rename your function(s) main and "
        "export again")
    assert _refusal(h.reads_reserved_names) == (
        "the exported script uses the name(s) ['STNB_OPTIONS', 'main'] itself; rename your "
        "global(s) STNB_OPTIONS, main and export again")


def test_partials_of_partials_and_of_objects_are_refused_naming_what_they_bind():
    import functools

    inner = functools.partial(h.takes_one)
    inner.note = "mine"  # a partial with attributes of its own: functools does not flatten a partial of it
    assert _refusal(functools.partial(inner, 1)) == (
        "export_script takes a function or one functools.partial of it, not a partial of a "
        "partial; combine the arguments into one partial")
    long = repr(h.LongRepr())
    assert _refusal(functools.partial(h.Builder(), h.LongRepr(), k=h.LongRepr())) == (
        f"the functools.partial of Builder() binds {long[:60]}, {long[:60]}, which exist only in "
        "this kernel; bind only numbers, strings, lists and dicts of them, or build those objects "
        "inside the function")


def test_a_callable_object_and_a_lambda_are_refused_with_the_fix():
    assert _refusal(h.Builder()) == "export_script takes a function defined with def in a cell; got Builder Builder()"
    assert _refusal(lambda: None) == (
        "a lambda has no name or source of its own a script can call; define the build function "
        "with def in a cell (def build(): ... return trainer) and export that")


def _closure(assign: bool):
    if assign:
        later = other = 1

    def build():
        return later, other

    return build


@pytest.mark.parametrize("assign", [True, False])
def test_a_closure_is_refused_naming_every_local_it_reads_even_one_never_assigned(assign):
    assert _refusal(_closure(assign)) == (
        "_closure.<locals>.build() closes over later, other, local variable(s) of the function it "
        "was defined in, which exist only in this kernel; define it at the top level of a cell "
        "and build those objects inside it (or pass numbers and strings with functools.partial)")


def test_a_function_without_source_kernel_objects_and_undefined_names_are_refused_naming_them():
    ns = {}
    exec("def made_by_exec():\n    return None\n", ns)
    refusal = _refusal(ns["made_by_exec"])
    assert refusal.startswith("the source of made_by_exec() cannot be found (")
    assert refusal.endswith("): it was made by exec/eval or in a session that is gone; define it with def in a "
                            "notebook cell or a .py file")
    assert _refusal(h.reads_two_kernel_objects) == (
        "reads_two_kernel_objects() reads global(s) that exist only in this kernel: "
        "OBJECT_AS_VALUE (a builtins.dict object built in the notebook); OBJECT_IN_A_LIST (a "
        "builtins.list object built in the notebook). A script has only imports, literals and "
        "functions: build these objects inside the function (load the dataset, create the model "
        "there)")
    assert _refusal(h.reads_undefined_names) == (
        "reads_undefined_names() uses NOT_DEFINED_A, NOT_DEFINED_B, not defined in this kernel; "
        "define or import them before exporting")


def test_a_functions_source_goes_in_without_trailing_blanks_and_ends_as_written():
    fn = _with_source_lines("tidy", ["def tidy():\n", "    MAX = 1\n", "    return MAX   \n"])
    assert build_source(fn).text == "def tidy():\n    MAX = 1\n    return MAX\n"


def test_global_objects_are_what_a_function_reads_and_imports_inside_itself():
    """What stnb.run checks before anything starts (a trainer class the build function reads or imports)."""
    import functools
    import json
    import os

    from stnb.buildsource import global_objects

    want = {"SIZE": h.SIZE, "len": len, "dumps": json.dumps, "loads": json.loads, "sep": os.sep}
    assert global_objects(h.imports_inside) == want  # not NOT_DEFINED_C: nothing by that name exists
    assert global_objects(functools.partial(h.imports_inside)) == want
    assert global_objects(len) == {} and global_objects(h.Builder()) == {}


def test_two_different_functions_of_one_name_are_refused(monkeypatch):
    import buildsource_other as other

    for fn in (h.shared_helper, other.shared_helper, other.calls_other_helper):
        monkeypatch.setattr(fn, "__module__", "__main__")  # all defined in the notebook: copied as source
    assert _refusal(h.reads_two_helpers_named_alike) == (
        "two different objects are named 'shared_helper' in the functions exported (function and "
        "function); rename one of them")


@pytest.fixture
def package_not_imported(monkeypatch):
    """buildsource_pkg and its submodules out of sys.modules, as a package the notebook never imported."""
    for name in [n for n in sys.modules if n == "buildsource_pkg" or n.startswith("buildsource_pkg.")]:
        monkeypatch.delitem(sys.modules, name)


def test_read_objects_imports_the_packages_a_function_imports_and_names_what_it_reads_of_them(
        package_not_imported):
    """What the strategies' build_refusal is given (DeepSpeed refusing ``losses.SoftmaxLoss(...)``): the
    objects, and each attribute the function reads of a module it holds, called or not."""
    import functools

    from stnb.buildsource import global_objects, read_objects

    assert global_objects(h.reads_a_package_it_imports) == {}  # nothing imported yet: nothing to name
    import buildsource_pkg  # the package alone: its submodule sub is not one of its attributes yet

    assert global_objects(h.reads_a_package_it_imports) == {}
    objects = read_objects(h.reads_a_package_it_imports, import_roots=("buildsource_pkg",))
    from buildsource_pkg import deep, sub

    want = {"sub": sub, "Other": deep.Other, "sub.Thing": sub.Thing, "sub.KIND": sub.KIND}
    assert objects == want
    assert read_objects(functools.partial(functools.partial(h.reads_a_package_it_imports)),
                        import_roots=("buildsource_pkg",)) == want
    assert read_objects(len) == {} and read_objects(h.Builder()) == {}


def test_read_objects_imports_nothing_outside_its_import_roots(package_not_imported):
    from stnb.buildsource import read_objects

    assert read_objects(h.reads_a_package_it_imports) == {}  # the default roots: sentence_transformers only
    assert "buildsource_pkg" not in sys.modules and "buildsource_pkg.deep" not in sys.modules
