"""``drafter.family: dflash2``: its params, the sizes it refuses by name, and what it builds."""

import pytest
from conftest import MASK_ID
from test_config import ROOT, cli

from dflash.config.params import load_config
from dflash.config.schema import DrafterConfig
from dflash.drafters.dflash2 import ARCHITECTURE, check_sizes
from dflash.errors import ConfigError
from dflash.model.dflash2_drafter import DFlash2Drafter
from dflash.model.families import family


class Tokenizer:
    mask_token_id, mask_token = MASK_ID, None


def _drafter_params(**values) -> DrafterConfig:
    return DrafterConfig(family="dflash2", block_size=4, num_target_features=2, **values)


def test_the_family_builds_a_dflash2_drafter_with_the_params_sizes(target):
    d = _drafter_params(conv_group_size=8, selector_rank=4, selector_top_k=5)
    kind = family("dflash2")
    drafter = kind.build(d, target, Tokenizer(), 0)
    assert isinstance(drafter, DFlash2Drafter) and kind.architecture == ARCHITECTURE
    assert drafter.candidate_selector.top_k == 5
    assert drafter.candidate_selector.hidden_projection.weight.shape == (4, 32)
    assert drafter.layers[0].attention_conv.group_size == 8


@pytest.mark.parametrize(
    "values, key",
    [
        ({"conv_group_size": 5}, "drafter.conv_group_size = 5"),
        ({"selector_top_k": 301}, "drafter.selector_top_k = 301"),
    ],
)
def test_sizes_that_cannot_work_on_the_target_are_refused_by_name(target, values, key):
    with pytest.raises(ConfigError, match=key):
        family("dflash2").build(_drafter_params(**values), target, Tokenizer(), 0)


def test_the_default_sizes_fit_the_tiny_default_target():
    config = load_config(ROOT / "params.yaml")
    check_sizes(config.drafter, config.target.hidden_size, config.tokenizer.vocab_size)


@pytest.mark.parametrize(
    "override, key",
    [
        ("drafter.conv_kernel_size=0", "drafter.conv_kernel_size"),
        ("drafter.conv_kernel_size=17", "drafter.conv_kernel_size"),
    ],
)
def test_sizes_that_never_work_exit_2_naming_them(tmp_path, override, key):
    proc = cli(tmp_path, "train", "--params", str(ROOT / "params.yaml"), "--set", override)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert key in proc.stderr
