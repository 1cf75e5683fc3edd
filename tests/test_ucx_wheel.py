"""The local path on PyPI's UCX: on a machine without Debian's libucx0, the libucx wheel
(the `ucx` extra, part of `test` and `demo`) is found in site-packages and carries the
KV. The machine without libucx0 is this one with the system's libucp hidden in a mount
namespace of a child process (root only, as CI runs), so nothing is uninstalled."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest
from pdd_transport import local

IN_CI = bool(os.environ.get("CI"))

# A receiver and a sender in one process, a grant of 3 pages of 2 layers moved by UCX.
TRANSFER = textwrap.dedent(
    """
    import json
    import numpy as np
    from pdd_transport import kv, local
    src = np.random.default_rng(3).integers(1, 255, (2, 8, 4096), dtype=np.uint8)
    dst = np.zeros_like(src)
    rx = local.LocalReceiver(kv.pool_from_buffers(dst, 4096, num_layers=2))
    tx = local.LocalSender(kv.pool_from_buffers(src, 4096, num_layers=2), "%s:%d" % rx.address)
    rx.wait_peer(timeout=20)
    inbound = rx.grant(5, [7, 0, 3], deadline_s=20)
    out = tx.wait_grant(5, timeout=20)
    for layer in range(2):
        out.send_layer(layer, [1, 2, 3])
    out.finish()
    landed = inbound.wait(timeout=20)
    ok = bool((dst[:, [7, 0, 3]] == src[:, [1, 2, 3]]).all()) and not dst[:, [1, 2, 4, 5, 6]].any()
    print(json.dumps({"library": local.ucx_library(), "version": local.ucx_version(), "bytes": landed, "ok": ok}))
    tx.close()
    rx.close()
    """
)


def system_libucp() -> str | None:
    for directory in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"):
        path = os.path.join(directory, "libucp.so.0")
        if os.path.exists(path):
            return os.path.realpath(path)
    return None


def test_the_wheels_library_is_found_without_importing_it() -> None:
    wheel = local.wheel_ucx_library()
    if wheel is None:
        if IN_CI:
            pytest.fail("the test extra installs libucx-cu12, but its libucp.so.0 was not found")
        pytest.skip("the libucx wheel is not installed here")
    assert wheel.endswith(os.path.join("libucx", "lib", "libucp.so.0")) and os.path.isfile(wheel)
    assert "libucx" not in sys.modules  # found, not imported: its import would load UCX itself


def test_a_machine_without_debians_ucx_moves_kv_on_the_wheels() -> None:
    wheel = local.wheel_ucx_library()
    if wheel is None:
        if IN_CI:
            pytest.fail("the test extra installs libucx-cu12, but its libucp.so.0 was not found")
        pytest.skip("the libucx wheel is not installed here")
    env = {k: v for k, v in os.environ.items() if k != "PDD_UCX_LIBRARY"}
    command = [sys.executable, "-c", TRANSFER]
    hidden = system_libucp()
    if hidden is not None:
        if os.geteuid() != 0 or shutil.which("unshare") is None:
            if IN_CI:
                pytest.fail("CI runs as root with unshare: the system's libucp could not be hidden")
            pytest.skip("hiding the system's libucp needs root and unshare")
        # A mount namespace of the child alone: /dev/null over the system's libucp, so
        # its dlopen fails as on a machine without libucx0.
        command = ["unshare", "-m", "sh", "-c", f'mount --bind /dev/null "{hidden}" && exec "$0" "$@"', *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"library": wheel, "version": result["version"], "bytes": 2 * 3 * 4096, "ok": True}
    assert tuple(int(x) for x in result["version"].split(".")[:2]) >= (1, 19)


def test_without_any_ucx_the_error_names_both_libraries(tmp_path: pathlib.Path) -> None:
    wheel = local.wheel_ucx_library()
    hidden = system_libucp()
    if wheel is None or os.geteuid() != 0 or shutil.which("unshare") is None:
        if IN_CI:
            pytest.fail("CI has root, unshare and the libucx wheel")
        pytest.skip("needs root, unshare and the libucx wheel")
    script = textwrap.dedent(
        """
        from pdd_transport import TransportError, local
        assert not local.available()
        try:
            local.ucx_version()
        except TransportError as e:
            print(e.reason, "|", e)
        """
    )
    # An empty regular file over both: the wheel's is still found (a file), and fails
    # to load like the system's.
    empty = tmp_path / "empty.so"
    empty.write_bytes(b"")
    mounts = [p for p in (hidden, wheel) if p is not None]
    binds = " && ".join(f'mount --bind "{empty}" "{p}"' for p in mounts)
    env = {k: v for k, v in os.environ.items() if k != "PDD_UCX_LIBRARY"}
    done = subprocess.run(["unshare", "-m", "sh", "-c", f'{binds} && exec "$0" "$@"', sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    reason, message = done.stdout.strip().split(" | ", 1)
    assert reason == "local_path_unavailable"
    assert "libucp.so.0" in message and wheel in message and "pdd_transport[ucx]" in message
