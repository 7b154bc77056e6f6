"""One module reads the environment: megatrain/files/env.py reads every `MEGATRAIN_*` variable and builds the cache
root, and docs/SETTINGS.md's table documents each. Read from the source by ast (nothing executed), with planted
controls."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from megatrain.files import env

ROOT = Path(__file__).resolve().parents[2]
READER = "megatrain/files/env.py"
NAME = re.compile(r"MEGATRAIN_[A-Z0-9_]+")


def _environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id == "os")


def _getenv(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "getenv" and isinstance(node.value, ast.Name)
            and node.value.id == "os")


def _keys_read(tree: ast.AST) -> list[tuple[ast.AST, ast.AST | None]]:
    """(key, the function it is read in) for each read of the environment: os.environ.get(k), os.environ[k] (loaded),
    k in os.environ, os.getenv(k); writes (os.environ[k] = v, pop, update, setdefault) are not reads."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def function_of(node: ast.AST) -> ast.AST | None:
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node
        return None

    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args and (
                _getenv(node.func) or (isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                                       and _environ(node.func.value))):
            key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn)) for o in node.ops) \
                and any(_environ(c) for c in node.comparators):
            key = node.left
        if key is not None:
            found.append((key, function_of(node)))
    return found


def bound_names(tree: ast.AST) -> set[str]:
    """The names a module binds to a MEGATRAIN_* variable's name (GUARD_ENV = "MEGATRAIN_DEEPSPEED_GUARD")."""
    return {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            and isinstance(n.value.value, str) and NAME.fullmatch(n.value.value)
            for t in n.targets if isinstance(t, ast.Name)}


def reads_variable(tree: ast.AST, bound: set[str]) -> bool:
    """Whether the module reads a MEGATRAIN_* variable: its key a string naming one, a name some module of the package
    binds to one (`bound`, imported or not), or a parameter of a function this module calls with such a key."""

    def megatrain(key: ast.AST) -> bool:
        return ((isinstance(key, ast.Constant) and isinstance(key.value, str) and bool(NAME.fullmatch(key.value)))
                or (isinstance(key, ast.Name) and key.id in bound))

    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    for key, function in _keys_read(tree):
        if megatrain(key):
            return True
        if isinstance(key, ast.Name) and function is not None:
            params = [a.arg for a in function.args.args]
            if key.id in params:
                at = params.index(key.id)
                for call in calls:
                    if call.func.id == function.name and (
                            (len(call.args) > at and megatrain(call.args[at]))
                            or any(k.arg == key.id and megatrain(k.value) for k in call.keywords)):
                        return True
            defaults = function.args.defaults
            offset = len(function.args.args) - len(defaults)
            if key.id in params and params.index(key.id) >= offset and megatrain(defaults[params.index(key.id) - offset]):
                return True
    return False


def builds_cache_root(tree: ast.AST) -> bool:
    strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return {".cache", "megatrain"} <= strings


def readers(package: Path) -> set[str]:
    """The modules under `package` besides the one reader that read a MEGATRAIN_* variable or build the cache root."""
    trees = {p.relative_to(package.parent).as_posix(): ast.parse(p.read_text(), filename=str(p))
             for p in sorted(package.rglob("*.py"))}
    bound = set().union(*(bound_names(t) for t in trees.values()))
    return {rel for rel, tree in trees.items()
            if rel != READER and (reads_variable(tree, bound) or builds_cache_root(tree))}


def test_one_module_reads_the_environment():
    assert readers(ROOT / "megatrain") == set()


@pytest.mark.parametrize("source,caught", [
    ('import os\nX = os.environ.get("MEGATRAIN_CACHE")\n', True),
    ('import os\nK = "MEGATRAIN_ADAM_KERNEL"\ndef f():\n    return K in os.environ\n', True),
    ('import os\nK = "MEGATRAIN_HOST_THREADS"\ndef f(name=K):\n    return os.getenv(name)\n', True),
    ('import os\nfrom pathlib import Path\nROOT = Path.home() / ".cache" / "megatrain"\n', True),
    ('import os\nK = "MEGATRAIN_LAUNCHED"\ndef f():\n    os.environ[K] = "1"\n', False),  # a write, not a read
    ('import os\nX = os.environ.get("CUDA_VISIBLE_DEVICES")\n', False),  # not MegaTrain's
    ('E = "set MEGATRAIN_CACHE=DIR to move it"\n', False),  # a message
    ('import os\nK = "MEGATRAIN_HOST_THREADS"\ndef read(name):\n    return os.environ.get(name, "")\nN = read(K)\n',
     True),  # through a helper's parameter
    ('import os\nK = "MEGATRAIN_X"\ndef f():\n    return os.environ.get("USE_V1")\n', False),  # reads another
    ('import os\nfrom .files.env import CACHE\nX = os.environ.get(CACHE)\n', True),  # a name bound elsewhere
])
def test_a_planted_read_is_caught(tmp_path, source, caught):
    pkg = tmp_path / "megatrain"
    (pkg / "files").mkdir(parents=True)
    (pkg / "files" / "env.py").write_text('import os\nCACHE = "MEGATRAIN_CACHE"\nX = os.environ.get(CACHE)\n')
    (pkg / "planted.py").write_text(source)
    assert readers(pkg) == ({"megatrain/planted.py"} if caught else set())


def _documented() -> set[str]:
    text = (ROOT / "docs" / "SETTINGS.md").read_text()
    table = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    return {m for line in table.splitlines() if line.startswith("| `") for m in NAME.findall(line.split(" | ")[0])}


def test_every_variable_read_is_documented():
    assert set(env.VARIABLES) <= _documented(), set(env.VARIABLES) - _documented()
    # and every MEGATRAIN_* string the package names is one the reader knows (a test's own kernel switch aside)
    named = {s for p in (ROOT / "megatrain").rglob("*.py")
             for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Constant) and isinstance(n.value, str)
             for s in [n.value] if NAME.fullmatch(s)}
    assert named <= set(env.VARIABLES), named - set(env.VARIABLES)


def test_the_reader_reads_when_asked(monkeypatch, tmp_path):
    monkeypatch.setenv(env.CACHE, str(tmp_path))
    assert env.cache_dir("probe") == tmp_path / "probe"
    monkeypatch.delenv(env.CACHE)
    assert env.cache_root() == Path.home() / ".cache" / "megatrain"
    monkeypatch.setenv(env.DEEPSPEED_GUARD, "0")
    assert env.deepspeed_left_alone()
    monkeypatch.setenv(env.DEEPSPEED_GUARD, "1")
    assert not env.deepspeed_left_alone()
    monkeypatch.delenv(env.LAUNCHED, raising=False)
    assert env.value(env.LAUNCHED) is None and not env.launched()
    monkeypatch.setenv(env.LAUNCHED, "1")
    assert env.value(env.LAUNCHED) == "1" and env.launched()
    with pytest.raises(ValueError, match="MEGATRAIN_NOT_ONE"):
        env.value("MEGATRAIN_NOT_ONE")
    monkeypatch.setenv(env.ADAM_KERNEL, "torch")
    assert env.kernel_off(env.ADAM_KERNEL) and not env.kernel_off(env.HILO_KERNEL)
    monkeypatch.delenv(env.NUMA, raising=False)
    assert not env.numa_off()
    for off in ("0", " Off ", "false", "NO"):
        monkeypatch.setenv(env.NUMA, off)
        assert env.numa_off(), off
    for on in ("1", "", "yes"):
        monkeypatch.setenv(env.NUMA, on)
        assert not env.numa_off(), on
