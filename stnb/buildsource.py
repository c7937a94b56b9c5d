"""A notebook's build function as standalone Python source (for ``stnb.export_script``), or why not.

    src = build_source(build)      # BuildSource: the text to put in a script, and its entry name
    src.text                       # imports, literals, helper functions, the function itself

What a script can hold: the function's own source (``inspect.getsource``), and for every global
name it reads (found in its bytecode, nested comprehensions and functions included, and in its
default values): ``import x`` for a module, ``from m import n`` for a function or class with an
importable ``__module__`` / ``__qualname__``, ``name = <literal>`` for a simple literal (numbers,
strings, and lists / tuples / dicts / sets of them), and the source of a helper function defined
in the notebook (checked the same way). Anything else exists only in this kernel, and the export
is refused naming it, with the fix (ConfigError): a closure over a local variable
(its free variables), a global holding an object built in the notebook (a dataset, a
model), a class defined in a cell, a lambda, a function whose source cannot be found (made by
``exec``), a decorated function.
"""

from __future__ import annotations

import ast
import builtins
import dis
import functools
import importlib
import inspect
import pprint
import textwrap
import types
from dataclasses import dataclass, field

from .errors import ConfigError

__all__ = ["BuildSource", "build_source", "global_objects", "read_objects", "LITERAL_MAX_CHARS", "RESERVED_NAMES"]

LITERAL_MAX_CHARS = 200_000  # a literal global longer than this is data: load it in the function instead
RESERVED_NAMES = ("main", "STNB_OPTIONS", "STNB_RESULTS_FILE")  # the exported script's own names
_LITERAL_TYPES = (int, float, complex, str, bytes, bool, type(None))


@dataclass
class BuildSource:
    """name: what the script passes to ``stnb.run`` (the function, or a functools.partial of it).
    text: the source: imports, literals, helper functions, the function (and the partial)."""

    name: str
    text: str
    imports: list = field(default_factory=list)
    literals: list = field(default_factory=list)
    functions: list = field(default_factory=list)


def build_source(build) -> BuildSource:
    """The standalone source of ``build`` (a function, or a functools.partial of one with literal
    arguments); ConfigError naming what keeps it in this kernel, and the fix."""
    args, kwargs = (), {}
    if isinstance(build, functools.partial):
        args, kwargs, build = build.args, dict(build.keywords), build.func
        if isinstance(build, functools.partial):
            raise ConfigError("export_script takes a function or one functools.partial of it, not a partial of a "
                              "partial; combine the arguments into one partial")
        bad = [repr(a) for a in list(args) + list(kwargs.values()) if not _is_literal(a)]
        if bad:
            raise ConfigError(f"the functools.partial of {getattr(build, '__name__', build)} binds "
                              f"{', '.join(b[:60] for b in bad)}, which exist only in this kernel; bind only "
                              "numbers, strings, lists and dicts of them, or build those objects inside the function")
    state = _State()
    state.add_function(build, top=True)
    name = build.__name__
    if args or kwargs:
        state.imports.add("import functools")
        call = ", ".join([name] + [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
        entry = "build" if name != "build" else "build_partial"
        state.bind(entry, ("partial", build))
        tail = f"\n\n{entry} = functools.partial({call})\n"
    else:
        entry, tail = name, ""
    clash = sorted(n for n in state.bound if n in RESERVED_NAMES)
    if clash:
        raise ConfigError(f"the exported script uses the name(s) {clash} itself; rename your "
                          f"{'function' if name in clash else 'global'}(s) {', '.join(clash)} and export again")
    imports = sorted(state.imports, key=lambda s: (s.startswith("from"), s))
    parts = ["\n".join(imports)] if imports else []
    if state.literals:
        parts.append("\n".join(state.literals))
    parts += [src.rstrip() + "\n" for src in state.functions]
    text = "\n\n\n".join(p.rstrip("\n") for p in parts) + "\n" + tail
    return BuildSource(name=entry, text=text, imports=imports, literals=list(state.literals),
                       functions=list(state.function_names))


class _State:
    def __init__(self):
        self.imports: set = set()
        self.literals: list = []
        self.functions: list = []
        self.function_names: list = []
        self.bound: dict = {}  # name in the script -> what it is bound to (one object per name)
        self.seen: set = set()

    def bind(self, name: str, what) -> bool:
        """Record that the script binds ``name``; False when already bound to the same thing."""
        if name in self.bound:
            if self.bound[name] != what:
                raise ConfigError(f"two different objects are named {name!r} in the functions exported "
                                  f"({self.bound[name][0]} and {what[0]}); rename one of them")
            return False
        self.bound[name] = what
        return True

    def add_function(self, fn, top: bool = False) -> None:
        label = getattr(fn, "__qualname__", None) or repr(fn)
        if not isinstance(fn, types.FunctionType):
            raise ConfigError(f"export_script takes a function defined with def in a cell; got {type(fn).__name__} "
                              f"{label}")
        if fn.__name__ == "<lambda>":
            raise ConfigError("a lambda has no name or source of its own a script can call; define the build "
                              "function with def in a cell (def build(): ... return trainer) and export that")
        if id(fn) in self.seen:
            return
        self.seen.add(id(fn))
        self.bind(fn.__name__, ("function", id(fn)))
        if fn.__closure__:
            names = sorted(fn.__code__.co_freevars)  # not getclosurevars: it raises on a cell not assigned yet
            raise ConfigError(f"{label}() closes over {', '.join(names)}, local variable(s) of the function it "
                              "was defined in, which exist only in this kernel; define it at the top level of a "
                              "cell and build those objects inside it (or pass numbers and strings with "
                              "functools.partial)")
        try:
            source = textwrap.dedent(inspect.getsource(fn))
        except (OSError, TypeError) as e:
            raise ConfigError(f"the source of {label}() cannot be found ({e}): it was made by exec/eval or in a "
                              "session that is gone; define it with def in a notebook cell or a .py file") from None
        node = _function_node(source, fn.__name__, label)
        names = _global_names(fn.__code__) | _default_names(node)
        missing, kernel_only = [], []
        for name in sorted(n for n in names if n.isidentifier()):  # not '@py_builtins' (pytest's rewriter)
            if name in fn.__globals__:
                why = self.add_global(name, fn.__globals__[name])
                if why:
                    kernel_only.append(why)
            elif not hasattr(builtins, name):
                missing.append(name)
        if kernel_only:
            raise ConfigError(f"{label}() reads global(s) that exist only in this kernel: {'; '.join(kernel_only)}. "
                              "A script has only imports, literals and functions: build these objects inside the "
                              "function (load the dataset, create the model there)")
        if missing:
            raise ConfigError(f"{label}() uses {', '.join(missing)}, not defined in this kernel; define or import "
                              "them before exporting")
        self.functions.append(source)
        self.function_names.append(fn.__name__)

    def add_global(self, name: str, obj) -> str:
        """Bind a global the function reads; returns why it cannot be, or ''."""
        if isinstance(obj, types.FunctionType) and id(obj) in self.seen:
            return ""  # a function already in the script (recursion)
        if isinstance(obj, types.ModuleType):
            if not _importable(obj.__name__, None, obj):
                return f"{name} (module {obj.__name__!r}, not importable)"
            short = obj.__name__.rpartition(".")[2]
            line = f"import {obj.__name__}" if name == obj.__name__ else f"import {obj.__name__} as {name}"
            if name == short and "." in obj.__name__:
                line = f"from {obj.__name__.rpartition('.')[0]} import {name}"
            if self.bind(name, ("module", obj.__name__)):
                self.imports.add(line)
            return ""
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if isinstance(module, str) and isinstance(qualname, str) and _importable(module, qualname, obj):
            if "." in qualname or "<" in qualname:
                return f"{name} ({module}.{qualname}: nested; import it at the top level of a module)"
            module = _public_module(module, qualname, obj)
            line = f"from {module} import {qualname}" + ("" if name == qualname else f" as {name}")
            if self.bind(name, ("import", f"{module}.{qualname}")):
                self.imports.add(line)
            return ""
        if isinstance(obj, types.FunctionType):  # a helper defined in the notebook: its source goes along
            if name != obj.__name__:
                return f"{name} (the function {obj.__name__} under another name; call it by its own name)"
            self.add_function(obj)
            return ""
        if _is_literal(obj):
            text = repr(obj)
            if len(text) > LITERAL_MAX_CHARS:
                return f"{name} (a {type(obj).__name__} of {len(text):,} characters: too large to copy into a script)"
            if self.bind(name, ("literal", text)):
                self.literals.append(f"{name} = {pprint.pformat(obj, width=110, sort_dicts=False)}")
            return ""
        kind = type(obj)
        where = "defined in a cell; move it to a .py module and import it" if inspect.isclass(obj) else \
            f"a {kind.__module__}.{kind.__qualname__} object built in the notebook"
        return f"{name} ({where})"


def _function_node(source: str, name: str, label: str) -> ast.FunctionDef:
    try:
        tree = ast.parse(source)
    except SyntaxError as e:  # e.g. getsource found the wrong lines
        raise ConfigError(f"the source found for {label}() does not parse ({e}); define it with def in a cell") \
            from None
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name != name:
        raise ConfigError(f"the source found for {label}() is not its def statement; define it with def in a cell")
    if node.decorator_list:
        raise ConfigError(f"{label}() is decorated ({', '.join(ast.unparse(d) for d in node.decorator_list)}); "
                          "export a plain function and apply the decorator's effect inside it")
    return node


def global_objects(fn) -> dict:
    """{name: object} of the globals a function reads (in its nested code too) that exist now, and of the
    names it imports inside itself (``from m import n`` in its body), from modules already imported."""
    import sys

    fn = _innermost(fn)
    code, env = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    if code is None:
        return {}
    out = {n: env[n] if n in env else vars(builtins)[n] for n in _global_names(code)
           if n in env or n in vars(builtins)}
    for module, name in _imported_names(code):
        mod = sys.modules.get(module)
        if mod is not None and hasattr(mod, name):
            out.setdefault(name, getattr(mod, name))
    return out


def read_objects(fn, import_roots: tuple = ("sentence_transformers",)) -> dict:
    """``global_objects(fn)``, and the attributes the function reads of the modules among them, named
    ``module.attribute`` (``losses.SoftmaxLoss`` when it writes ``losses.SoftmaxLoss(...)``). Modules
    under ``import_roots`` that the function imports in its body are imported here first (the ranks
    import them anyway; sentence-transformers starts no device)."""
    import importlib
    import sys

    code = getattr(_innermost(fn), "__code__", None)
    if code is None:  # a builtin, a callable object: no code to read
        return {}
    for module, name in _imported_names(code):
        if module.split(".")[0] in import_roots:
            if module not in sys.modules:
                importlib.import_module(module)
            if not hasattr(sys.modules[module], name):  # a submodule (``from sentence_transformers import losses``)
                try:
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    pass
    objects = global_objects(fn)
    attributes = _attribute_names(code)
    for name, obj in list(objects.items()):
        if isinstance(obj, types.ModuleType):
            objects.update({f"{name}.{a}": getattr(obj, a) for a in attributes if hasattr(obj, a)})
    return objects


def _innermost(fn):
    """The function under any layers of ``functools.partial``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def _attribute_names(code) -> set:
    """Names the code reads as attributes (``x.name``), in nested code too."""
    return _loaded_names(code, ("LOAD_ATTR", "LOAD_METHOD"))


def _imported_names(code) -> set:
    """(module, name) of every ``from module import name`` in the code (nested code too)."""
    found, module = set(), None
    for ins in dis.get_instructions(code):
        if ins.opname == "IMPORT_NAME":
            module = ins.argval
        elif ins.opname == "IMPORT_FROM" and module:
            found.add((module, ins.argval))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= _imported_names(const)
    return found


def _global_names(code) -> set:
    """Global names the code reads, in nested code (comprehensions, inner functions) too. Unlike
    ``inspect.getclosurevars``, attribute names (``trainer.model``) are not taken for globals."""
    return _loaded_names(code, ("LOAD_GLOBAL",))


def _loaded_names(code, opnames: tuple) -> set:
    """The names the code's ``opnames`` instructions load, in its nested code objects too."""
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in opnames}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _loaded_names(const, opnames)
    return names


def _default_names(node) -> set:
    """Names the def statement's default values read (evaluated when the script defines it)."""
    exprs = list(node.args.defaults) + [d for d in node.args.kw_defaults if d is not None]
    return {n.id for e in exprs for n in ast.walk(e) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _importable(module: str, qualname: str | None, obj) -> bool:
    if module.startswith("__"):  # __main__: this kernel
        return False
    try:
        found = importlib.import_module(module)
        for part in (qualname.split(".") if qualname else []):
            found = getattr(found, part)
    except Exception:
        return False
    return found is obj


def _public_module(module: str, qualname: str, obj) -> str:
    """The shortest parent package that exports ``obj`` under its name (``sentence_transformers``
    rather than ``sentence_transformers.sentence_transformer.model``), else ``module``."""
    parts = module.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if _importable(parent, qualname, obj):
            return parent
    return module


def _is_literal(obj, depth: int = 0) -> bool:
    """Numbers, strings, bytes, None and containers of them, whose repr reads back equal."""
    if depth > 20:
        return False
    if isinstance(obj, bool) or type(obj) in _LITERAL_TYPES:
        ok = True
    elif type(obj) in (list, tuple, set, frozenset):
        ok = all(_is_literal(x, depth + 1) for x in obj)
    elif type(obj) is dict:
        ok = all(_is_literal(k, depth + 1) and _is_literal(v, depth + 1) for k, v in obj.items())
    else:
        return False
    if not ok:
        return False
    if depth:
        return True
    try:
        return ast.literal_eval(repr(obj)) == obj
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return False
