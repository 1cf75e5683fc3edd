"""The shape of the source tree: no library file over 1,000 lines.

A file that long is doing several jobs; split it by responsibility (``foo.rs`` ->
``foo/mod.rs`` + ``foo/<job>.rs``, a Python module -> sibling modules). Tests do not
count: files under a ``tests/`` folder and Rust ``tests.rs`` files (an inline
``#[cfg(test)] mod tests { ... }`` does count: move it to ``tests.rs``).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MAX_LINES = 1000

SOURCE_SUFFIXES = {".rs", ".py", ".pyi"}



def source_roots() -> list[Path]:
    return sorted((ROOT / "rust").glob("*/src")) + [ROOT / "python" / "pdd_transport"]


def is_test_file(rel: Path) -> bool:
    return "tests" in rel.parts[:-1] or rel.name == "tests.rs"


def library_files() -> list[Path]:
    files = []
    for root in source_roots():
        for path in root.rglob("*"):
            rel = path.relative_to(ROOT)
            if path.suffix in SOURCE_SUFFIXES and path.is_file() and "__pycache__" not in rel.parts:
                if not is_test_file(rel):
                    files.append(path)
    return sorted(files)


def line_count(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


def test_the_walk_sees_every_crate_and_the_package() -> None:
    # A walk that finds nothing would pass the bound trivially.
    rel = {p.relative_to(ROOT).as_posix() for p in library_files()}
    for crate in ("pdd-core", "pdd-io", "pdd-py"):
        assert f"rust/{crate}/src/lib.rs" in rel
    assert "python/pdd_transport/__init__.py" in rel
    assert "python/pdd_transport/_native.pyi" in rel
    assert not any(is_test_file(Path(p)) for p in rel)


def test_no_library_file_over_the_bound() -> None:
    over = {
        p.relative_to(ROOT).as_posix(): n for p in library_files() if (n := line_count(p)) > MAX_LINES
    }
    assert over == {}, (
        f"files over {MAX_LINES} lines (split them by responsibility): "
        + ", ".join(f"{p} ({n} lines)" for p, n in sorted(over.items()))
    )


def test_test_files_are_told_apart() -> None:
    assert is_test_file(Path("rust/pdd-io/src/receiver/tests.rs"))
    assert is_test_file(Path("rust/pdd-core/tests/handoff_unit.rs"))
    assert not is_test_file(Path("rust/pdd-core/src/wire/testing.rs"))
    assert not is_test_file(Path("python/pdd_transport/bench/stream.py"))
