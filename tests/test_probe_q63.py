"""Probe Q63 findings for an installed tiercache without some extras: a missing optional
package is named with the extra that brings it (``pip install 'tiercache[hf]'``), not shown
as a traceback (``tiercache bench`` without torch) or with a checkout-only ``pip install -e``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tiercache import cli
from tiercache.cli import bench
from tiercache import extras
from tiercache.extras import EXTRAS, install_hint, missing_extra


def _without(module: str, code: str) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter where importing ``module`` fails as if not installed."""
    prelude = f"import sys; sys.modules[{module!r}] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120)


def test_the_cli_names_the_extra_of_a_missing_package(monkeypatch, capsys):
    def needs_torch(args):
        raise ModuleNotFoundError("No module named 'torch'", name="torch")

    monkeypatch.setattr(bench, "main", needs_torch)
    monkeypatch.setattr(extras, "installed", lambda module: module != "torch")
    assert cli.main(["bench"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tiercache bench: error: needs torch, which is not installed here: pip install 'tiercache[cpu]'")
    assert "Traceback" not in err


def test_the_cli_still_raises_a_missing_module_no_extra_brings(monkeypatch):
    def broken(args):
        raise ModuleNotFoundError("No module named 'no_such_thing'", name="no_such_thing")

    monkeypatch.setattr(bench, "main", broken)
    with pytest.raises(ModuleNotFoundError, match="no_such_thing"):
        cli.main(["bench"])  # a defect of ours, not a missing extra: the traceback is the report


def test_the_data_plane_api_names_the_cpu_extra_without_torch():
    done = _without("torch", "import tiercache\ntiercache.TieredKVStore")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: tiercache.TieredKVStore needs torch, which is not installed here: "
                           "pip install 'tiercache[cpu]'"), last


def test_the_transformers_cache_names_the_hf_extra_without_transformers():
    done = _without("transformers", "from tiercache.integrations.transformers import TieredCache")
    last = done.stderr.strip().splitlines()[-1]
    assert last == ("ModuleNotFoundError: tiercache.integrations (the transformers cache) needs transformers, which is "
                    "not installed here: pip install 'tiercache[hf]'"), last


def test_every_extra_hint_names_a_real_extra_of_the_package():
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml")
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for module, extra in EXTRAS.items():
        assert extra in extras, (module, extra)
        assert f"pip install 'tiercache[{extra}]'" in install_hint(module)
        assert "-e" not in install_hint(module).split()  # works outside a checkout
    assert missing_extra(ModuleNotFoundError("x", name="numpy")) is None


def test_an_installed_package_missing_a_submodule_is_not_called_not_installed(monkeypatch):
    """Review R35: transformers 4 lacks ``transformers.masking_utils``; "not installed" would
    mislead, so the traceback, which names the module, is left as it is."""
    monkeypatch.setattr(extras, "installed", lambda module: module == "transformers")
    assert missing_extra(ModuleNotFoundError("x", name="transformers.masking_utils")) is None
    assert missing_extra(ModuleNotFoundError("x", name="mooncake.store")).startswith("needs mooncake, which is not")


def test_a_policy_module_off_the_path_says_where_python_looks():
    from tiercache.policies import PolicyError, get_eviction

    with pytest.raises(PolicyError) as raised:
        get_eviction("not_on_any_path_q63:MyFIFO")
    message = str(raised.value)
    assert message.startswith("cannot load eviction policy 'not_on_any_path_q63:MyFIFO': ModuleNotFoundError")
    assert "set PYTHONPATH to the folder holding it, or run python -m tiercache" in message
    assert message.count("not_on_any_path_q63:MyFIFO") == 1  # the spec once, not twice


def test_a_policy_module_whose_own_import_fails_gets_no_path_hint(tmp_path, monkeypatch):
    from tiercache.policies import PolicyError, get_eviction

    (tmp_path / "needs_missing_q63.py").write_text("import no_such_dependency_q63\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PolicyError, match="No module named 'no_such_dependency_q63'") as raised:
        get_eviction("needs_missing_q63:X")
    assert "PYTHONPATH" not in str(raised.value)  # found; its own dependency is what is missing
