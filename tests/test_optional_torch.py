"""torch is an optional extra (``pdd_transport[torch]``): what works without it, and what
says clearly that it is needed. Each check runs in a subprocess whose imports of torch
fail, as on a machine without the extra (a finder first in ``sys.meta_path``)."""

from __future__ import annotations

import subprocess
import sys

HIDE_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoTorch())
"""


def run_without_torch(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", HIDE_TORCH + code], capture_output=True, text=True, timeout=120, check=False
    )


def test_roles_import_without_torch() -> None:
    out = run_without_torch("import pdd_transport.roles, sys; assert 'torch' not in sys.modules")
    assert out.returncode == 0, out.stderr


def test_roles_import_does_not_load_torch_even_where_installed() -> None:
    code = "import pdd_transport.roles, sys; assert 'torch' not in sys.modules"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr


def test_the_package_and_cli_import_without_torch() -> None:
    out = run_without_torch("import pdd_transport, pdd_transport.cli, pdd_transport.bench.handoff, sys")
    assert out.returncode == 0, out.stderr


def test_demo_without_torch_says_how_to_install_it() -> None:
    out = run_without_torch("from pdd_transport.cli import main\nsys.exit(main(['demo', '--quick', '--json']))")
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "pip install 'pdd_transport[torch]'" in out.stderr
    assert "Traceback" not in out.stderr
    assert out.stdout == ""
