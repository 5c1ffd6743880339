"""The example config in deploy/ stays valid and equals the defaults it documents."""

import pytest

from cluster.config import load_toml, resolve
from tests.helpers import ROOT

pytestmark = pytest.mark.pure


def test_example_config_is_the_defaults():
    assert resolve(load_toml(ROOT / "deploy" / "local.toml")) == resolve({})
