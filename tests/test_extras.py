"""Install hints fit how dapo was installed: a pasted hint adds the extra to this copy."""

from __future__ import annotations

import json
from importlib import metadata

from dapo import extras
from dapo.extras import pip_install


def test_from_a_checkout_the_hint_installs_the_checkout_editable(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'dapo-rl'\n")
    module = tmp_path / "dapo" / "extras.py"
    assert pip_install("vllm", str(module)) == f"pip install -e '{tmp_path}[vllm]'"


class _Dist:
    def __init__(self, direct_url):
        self.direct_url = direct_url

    def read_text(self, name):
        return None if self.direct_url is None else json.dumps(self.direct_url)


def test_from_site_packages_the_hint_names_pypi_or_the_local_source(tmp_path, monkeypatch):
    installed = tmp_path / "site-packages" / "dapo" / "extras.py"  # no pyproject above
    source = tmp_path / "src"
    source.mkdir()
    for direct_url, want in [
        (None, "pip install 'dapo-rl[lora]'"),  # from PyPI: pip writes no file:// URL
        ({"url": "https://example.org/dapo_rl-0.2.0.whl"}, "pip install 'dapo-rl[lora]'"),
        ({"url": f"file://{source}", "dir_info": {}}, f"pip install '{source}[lora]'"),
        ({"url": f"file://{tmp_path / 'gone'}", "dir_info": {}}, "pip install 'dapo-rl[lora]'"),
    ]:
        monkeypatch.setattr(extras.metadata, "distribution", lambda n, d=direct_url: _Dist(d))
        assert pip_install("lora", str(installed)) == want, direct_url

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(extras.metadata, "distribution", missing)
    assert pip_install("gguf", str(installed)) == "pip install 'dapo-rl[gguf]'"
