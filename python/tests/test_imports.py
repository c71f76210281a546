"""The package's import graph: no cycle among laden's own modules, and
almost no import of them from inside a function (the way a cycle hides).

Read from the source with ``ast``, so it holds for every module whether
or not a test imports it.  Both kinds of import count as edges: one made
inside a function is still an arrow between the modules.
"""

import ast
import os
import pathlib
import subprocess
import sys

import laden

SRC = pathlib.Path(__file__).resolve().parents[1] / "laden"

# Cycles allowed: none (the last, _model <-> training, went when a block
# began calling its trainer's call() instead of importing train_call).
KNOWN_CYCLES = set()

# Files whose function-level imports are not counted below: none.
NOT_YET_COUNTED = set()

# At most this many imports of laden's own modules inside functions in the
# rest of the package, each with a comment on its line or the line above
# saying why it cannot be at the top.
MAX_FUNCTION_LEVEL = 5


def _modules():
    names = sorted(p.stem for p in SRC.glob("*.py"))
    assert "streaming" in names and "_describe" in names, SRC
    return names


def _targets(node, modules):
    """The laden modules an import statement names ("__init__" for the
    package itself: ``from . import __version__``)."""
    def module_of(dotted):
        head = dotted.split(".")[0]
        return head if head in modules else "__init__"

    out = []
    if isinstance(node, ast.ImportFrom):
        if node.level == 1:
            if node.module:
                out.append(module_of(node.module))
            else:
                out += [module_of(a.name) for a in node.names]
        elif node.level == 0 and node.module and (
                node.module == "laden" or node.module.startswith("laden.")):
            rest = node.module[len("laden."):] if "." in node.module else ""
            if rest:
                out.append(module_of(rest))
            else:
                out += [module_of(a.name) for a in node.names]
        elif node.level > 1:
            out.append("__init__")  # laden has no subpackage to climb from
    elif isinstance(node, ast.Import):
        for a in node.names:
            if a.name.startswith("laden."):
                out.append(module_of(a.name[len("laden."):]))
            elif a.name == "laden":
                out.append("__init__")
    return out


def _imports(name, modules, text=None):
    """[(target, line, inside_function)] for module `name` (or for source
    `text`, read as that module)."""
    path = SRC / f"{name}.py"
    tree = ast.parse(text if text is not None else
                     path.read_text(encoding="utf-8"), str(path))
    found = []

    def visit(node, in_fn):
        for child in ast.iter_child_nodes(node):
            fn = in_fn or isinstance(child, (ast.FunctionDef,
                                             ast.AsyncFunctionDef,
                                             ast.Lambda))
            for t in _targets(child, modules):
                found.append((t, child.lineno, fn))
            visit(child, fn)

    visit(tree, False)
    return found


def _graph():
    modules = _modules()
    return {m: {t for t, _, _ in _imports(m, modules) if t != m}
            for m in modules}


def _cycles(graph):
    """The strongly connected components of more than one module
    (Tarjan's algorithm, iterative: no recursion limit to meet)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.add(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(frozenset(comp))
            elif w not in graph:
                continue
            elif w not in index:
                index[w] = low[w] = counter[0]
                counter[0] += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def test_graph_sees_the_imports():
    # The reader itself: known top-level edges are there, and an import
    # inside a function is seen as one, so an empty graph cannot pass the
    # tests below.
    g = _graph()
    assert "_describe" in g["streaming"]
    assert "streaming" in g["hf"]
    assert "_bind" in g["training"]
    src = ("from . import _lib\n"
           "def f():\n"
           "    from .training import train_call\n"
           "    import laden.cache\n")
    assert _imports("x", _modules(), src) == [
        ("_lib", 1, False), ("training", 3, True), ("cache", 4, True)]


def test_cycle_finder():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(g) == [frozenset("abc")]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    cycles = set(_cycles(_graph()))
    new = cycles - KNOWN_CYCLES
    assert not new, (
        "laden's modules import each other in a circle: "
        + "; ".join(" <-> ".join(sorted(c)) for c in new)
        + " (move what the lower module needs into a module below both)")


def test_core_does_not_import_the_integrations():
    # hf, gguf's loaders and sharing sit on top of the core; streaming,
    # adapters, graphs and cache reach none of hf and the cli.
    g = _graph()

    def reach(m):
        seen, todo = set(), [m]
        while todo:
            for t in g.get(todo.pop(), ()):
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return seen

    for core in ("streaming", "adapters", "graphs", "cache", "_sched",
                 "_moves"):
        assert not reach(core) & {"hf", "cli", "demo", "__init__"}, core


def test_few_function_level_imports_each_commented():
    modules = _modules()
    inside, bare = [], []
    for m in modules:
        if m in NOT_YET_COUNTED:
            continue
        lines = (SRC / f"{m}.py").read_text(encoding="utf-8").splitlines()
        for t, line, fn in _imports(m, modules):
            if not fn:
                continue
            inside.append(f"{m}.py:{line} -> {t}")
            here, above = lines[line - 1], lines[line - 2] if line > 1 else ""
            if "#" not in here and not above.strip().startswith("#"):
                bare.append(f"{m}.py:{line}")
    assert len(inside) <= MAX_FUNCTION_LEVEL, inside
    assert not bare, ("a function-level import of a laden module needs a "
                      "comment saying why it is not at the top: "
                      + ", ".join(bare))


def test_moved_names_still_importable_where_they_were():
    from laden import hf, streaming
    from laden._moves import _same_device, unguard_moves
    from laden._sched import _end_interrupted, _pass

    assert hf.unguard_moves is unguard_moves
    assert hf._same_device is _same_device
    assert streaming._pass is _pass
    assert streaming._end_interrupted is _end_interrupted


def test_imports_without_the_optional_packages():
    # A fresh interpreter where transformers, diffusers, peft, gguf and
    # accelerate cannot be imported: laden (and its cli) still import.
    code = ("import sys\n"
            "for m in ('transformers', 'diffusers', 'peft', 'gguf', "
            "'accelerate', 'matplotlib'):\n"
            "    sys.modules[m] = None\n"
            "import laden, laden.cli\n"
            "print(laden.__version__)\n")
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == laden.__version__
