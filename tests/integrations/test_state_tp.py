"""How vLLM shards recurrent states over TP ranks (`kvtier.integrations.vllm.model.state_tp`), from the
shapes of the tiny models' layers (`kvtier.tools.tiny_models`) at TP=1 and TP=2 as vLLM's
`MambaStateShapeCalculator` gives them, channels first: the sections are vLLM's conv-weight shards
(q, k, v; x, B, C) and heads, and a shape that is no shard of them is refused."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.format.state_shards import Section
from kvtier.integrations.vllm.model.state_tp import state_sections

# qwen3-next: 2 key and 2 value heads of 64, kernel 4: conv 2*128 + 128 channels
GDN_WHOLE = ((384, 3), (2, 64, 64))
GDN_TP2 = ((192, 3), (1, 64, 64))
# granite-hybrid: 4 heads of 64 (x: 256 channels), one group of d_state 16, kernel 4
MAMBA2_WHOLE = ((288, 3), (4, 64, 16))
MAMBA2_TP2 = ((160, 3), (2, 64, 16))  # vLLM extends the one group to 2, one per rank: B, C whole


def test_gdn_conv_channels_are_q_k_v_and_the_state_is_by_heads() -> None:
    sections = state_sections("gdn", GDN_TP2, GDN_WHOLE, 2)
    assert sections == ((Section(128), Section(128), Section(128)), (Section(2),))


def test_mamba2_with_one_group_gives_every_rank_b_and_c_whole() -> None:
    sections = state_sections("mamba2", MAMBA2_TP2, MAMBA2_WHOLE, 2)
    assert sections == ((Section(256), Section(16, True), Section(16, True)), (Section(4),))


def test_mamba2_with_groups_tp_divides_splits_them() -> None:
    whole = ((256 + 2 * 2 * 16, 3), (4, 64, 16))
    local = ((128 + 2 * 16, 3), (2, 64, 16))
    assert state_sections("mamba2", local, whole, 2) == (
        (Section(256), Section(32), Section(32)), (Section(4),))


def test_tp1_is_one_whole_shard() -> None:
    assert state_sections("gdn", GDN_WHOLE, GDN_WHOLE, 1)[1] == (Section(2),)


def test_shapes_that_are_no_shard_are_refused() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        state_sections("gdn", ((190, 3), (1, 64, 64)), GDN_WHOLE, 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        state_sections("mamba2", ((160, 3), (4, 64, 16)), MAMBA2_WHOLE, 2)
    with pytest.raises(ConfigError, match="gdn or mamba2"):
        state_sections("short_conv", GDN_TP2, GDN_WHOLE, 2)


def test_the_shapes_above_are_vllms() -> None:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Calc

    def channels_first(shapes: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
        conv, state = shapes
        return (conv if conv[0] > conv[1] else conv[::-1], tuple(state))

    for tp, want in ((1, GDN_WHOLE), (2, GDN_TP2)):
        assert channels_first(Calc.gated_delta_net_state_shape(tp, 2, 2, 64, 64, 4)) == want
    for tp, want in ((1, MAMBA2_WHOLE), (2, MAMBA2_TP2)):
        assert channels_first(Calc.mamba2_state_shape(tp, 256, 1, 4, 64, 16, 4)) == want
