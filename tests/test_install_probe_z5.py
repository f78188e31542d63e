"""tiercache installed and used outside the checkout (probe Z5).

* A read-only install with no writable home: numba has nowhere to keep compiled code, and its
  ``cache=True`` raised at import. The kernels now compile without the on-disk cache, after
  one warning (simulated here by leaving numba no cache locator).
* The kernel cache stamp covers ``tiercache/sim``'s compiled modules in the installed layout
  (``tiercache/policies`` inside ``tiercache/``), not only in the checkout's.
* The CLI starts without matplotlib; ``python -m tiercache`` runs it.
* The sdist holds the tests' data, the scripts and the CI entry point; its metadata carries
  the SPDX license.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import tiercache
from tiercache.policies import kernels

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads TOML")

ROOT = Path(__file__).resolve().parent.parent
# Every cache folder numba tries (__pycache__, NUMBA_CACHE_DIR, ~/.cache/numba) read-only.
READ_ONLY = ("import numba.core.caching as c\n"
             "def read_only(self):\n    raise PermissionError(13, 'Read-only file system', self.get_cache_path())\n"
             "c._CacheLocator.ensure_cache_path = read_only\n")
needs_numba = pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba not installed or TIERCACHE_NO_NUMBA set")


def _python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """Runs ``python -c code`` in ``cwd`` (outside the checkout) with ``env`` added."""
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def no_cache_locator(monkeypatch):
    """numba as in a read-only install with no writable home: every cache folder it tries is
    read-only, so it finds no locator for any file. (``codec_kernels`` is imported first: this
    process's kernels keep their cache.)"""
    caching = pytest.importorskip("numba.core.caching")
    pytest.importorskip("tiercache.data.codec_kernels")

    def read_only(locator):
        raise PermissionError(13, "Read-only file system", locator.get_cache_path())

    monkeypatch.setattr(caching._CacheLocator, "ensure_cache_path", read_only)
    kernels._warn_no_disk_cache.cache_clear()
    yield
    kernels._warn_no_disk_cache.cache_clear()


@needs_numba
def test_kernels_compile_without_disk_cache_when_numba_has_nowhere_to_keep_it(no_cache_locator, recwarn):
    add_one = kernels.njit(lambda x: x + 1)
    twice = kernels.njit_inline(lambda x: 2 * x)
    assert add_one(2) == 3 and twice(4) == 8
    assert type(add_one._cache).__name__ == "NullCache", "compiled without the on-disk cache"
    warned = [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert [str(w.message) for w in warned] == [kernels.NO_DISK_CACHE], "one warning, however many kernels"


@needs_numba
def test_codec_kernels_import_silently_when_numba_cannot_cache(tmp_path):
    code = READ_ONLY + "from tiercache.data import codec_kernels; print(codec_kernels._JIT['cache'])"
    done = _python(code, tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, "False\n", "")


@needs_numba
def test_codec_kernels_keep_the_disk_cache_where_numba_can():
    from tiercache.data import codec_kernels

    assert codec_kernels._disk_cache_usable() is True


@needs_numba
def test_cli_starts_without_a_traceback_when_numba_cannot_cache(tmp_path):
    done = _python(READ_ONLY + "import sys; from tiercache.cli import main; sys.exit(main(['--version']))", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"tiercache {tiercache.__version__}\n"
    assert "Traceback" not in done.stderr
    assert done.stderr.count(kernels.NO_DISK_CACHE) == 1, done.stderr


def test_every_stamped_source_exists():
    missing = [str(p) for p in kernels.stamped_sources() if not p.exists()]
    assert missing == [], "stamped paths that do not exist"
    names = {p.name for p in kernels.stamped_sources()}
    assert {f"{m}.py" for m in kernels.STAMPED_SIM_MODULES} <= names


def _installed_copy(target: Path) -> Path:
    """The source packages laid out as an install does (``tiercache/policies``, ``tiercache/cuda_ext``)."""
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "tiercache", target / "tiercache", ignore=ignore)
    shutil.copytree(ROOT / "policies", target / "tiercache" / "policies", ignore=ignore)
    shutil.copytree(ROOT / "cuda_ext", target / "tiercache" / "cuda_ext", ignore=ignore)
    return target


def test_stamp_covers_the_sim_modules_in_an_installed_layout(tmp_path):
    site = _installed_copy(tmp_path / "site")
    code = ("import tiercache; from tiercache.policies.kernels import stamped_sources; "
            "print(tiercache.__file__); [print(p, p.exists()) for p in stamped_sources()]")
    done = _python(code, tmp_path, PYTHONPATH=str(site), TIERCACHE_NO_NUMBA="1")
    assert done.returncode == 0, done.stderr
    first, *lines = done.stdout.splitlines()
    assert first == str(site / "tiercache" / "__init__.py"), "the installed copy was imported"
    sim = [line for line in lines if "/sim/" in line]
    assert len(sim) == len(kernels.STAMPED_SIM_MODULES)
    assert all(line == f"{site / 'tiercache' / 'sim'}/{Path(line.split()[0]).name} True" for line in sim), sim


def test_cli_imports_no_matplotlib(tmp_path):
    code = ("import sys; from tiercache.cli import main\n"
            "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'matplotlib'}))")
    done = _python(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def test_python_m_tiercache_runs_the_cli(tmp_path):
    version = subprocess.run([sys.executable, "-m", "tiercache", "--version"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
    assert (version.returncode, version.stdout) == (0, f"tiercache {tiercache.__version__}\n"), version.stderr
    bad = subprocess.run([sys.executable, "-m", "tiercache", "no-such-command"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def _sdist(tmp_path: Path) -> tarfile.TarFile:
    """The sdist of a copy of the checkout (built in process, no isolation: fast)."""
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis")
    for folder in ("tiercache", "policies", "cuda_ext", "tests", "scripts", ".ci"):
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    for name in ("pyproject.toml", "MANIFEST.in", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path / 'dist')!r}))"
    done = _python(code, source)
    assert done.returncode == 0, done.stderr
    return tarfile.open(tmp_path / "dist" / done.stdout.split()[-1])


def test_sdist_holds_test_data_scripts_and_ci(tmp_path):
    with _sdist(tmp_path) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
        pkg_info = sdist.extractfile(next(n for n in sdist.getnames() if n.endswith("/PKG-INFO") and n.count("/") == 1))
        metadata = pkg_info.read().decode()
    data = {str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "data").rglob("*") if p.is_file()}
    assert data - names == set(), "tests/data files missing from the sdist"
    assert {"tests/conftest.py", "tests/import_graph.py", "scripts/disagg_demo.py", ".ci/run"} <= names
    assert not [n for n in names if "__pycache__" in n]
    assert "License-Expression: Apache-2.0" in metadata


def test_build_requires_a_setuptools_that_reads_spdx_licenses():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert isinstance(config["project"]["license"], str), "the SPDX string form, not the deprecated table"
    setuptools = next(r for r in config["build-system"]["requires"] if r.startswith("setuptools"))
    floor = re.fullmatch(r"setuptools\s*>=\s*(\d+)(\.\d+)*", setuptools)
    assert floor and int(floor.group(1)) >= 77, f"{setuptools!r}: SPDX licenses need setuptools>=77"
