"""The packages' dependencies point one way, checked on every module's imports (ast).

    kernels  ←  kvstore  ←  kvfleet (the core)  ←  producer | scheduler | workers

- The core imports no service; only its development tooling (the CLI, the local fleet
  and infrastructure launchers), which starts everything, may.
- The three services never import each other: what they share lives in the core.
- kvstore and kernels are resources below the services: they import no service either,
  and kernels imports nothing of kvfleet's at all.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICES = {"producer", "scheduler", "workers"}
PACKAGES = SERVICES | {"kvfleet", "kvstore", "kernels"}
#: Parts of a core module's path that mark development tooling.
TOOLING = ("cli", "fleet", "infra", "__main__")


def imported(tree: ast.AST) -> set[str]:
    """Top-level packages a module imports, `__import__("x")` and `import_module("x")` included."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                "__import__", "import_module") and node.args and isinstance(node.args[0], ast.Constant):
            found.add(str(node.args[0].value).split(".")[0])
    return found & PACKAGES


def forbidden(path: Path) -> set[str]:
    """The packages a module at `path` (relative to the repository) must not import."""
    top = path.parts[0]
    if top == "kvfleet":
        stem_parts = [p.removesuffix(".py") for p in path.parts[1:]]
        return set() if any(p.startswith(TOOLING) for p in stem_parts) else set(SERVICES)
    if top in SERVICES:
        return SERVICES - {top}
    if top == "kvstore":
        return set(SERVICES)
    if top == "kernels":
        return PACKAGES - {"kernels"}
    return set()


def violations(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] not in PACKAGES:
            continue
        bad = imported(ast.parse(path.read_text(), str(rel))) & forbidden(rel)
        out += [f"{rel} imports {name}" for name in sorted(bad)]
    return out


def test_dependencies_point_one_way():
    assert violations(ROOT) == []


def test_the_check_sees_each_kind_of_arrow(tmp_path):
    files = {
        "kvfleet/jobs.py": "from producer.client import Client\n",  # core -> service
        "kvfleet/cli.py": "import producer.client\n__import__('workers.service')\n",  # tooling: allowed
        "kvfleet/infra/up.py": "from scheduler import service\n",  # tooling: allowed
        "scheduler/run.py": "def f():\n    from workers.celery_app import make_celery\n",  # service -> service
        "producer/api.py": "import importlib\nimportlib.import_module('scheduler.ledger')\n",
        "kernels/ops.py": "from kvfleet import settings\n",  # kernels -> core
        "workers/ok.py": "from kvfleet import ledger\nfrom kvstore import lock\nfrom .x import y\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert violations(tmp_path) == [
        "kernels/ops.py imports kvfleet",
        "kvfleet/jobs.py imports producer",
        "producer/api.py imports scheduler",
        "scheduler/run.py imports workers",
    ]
