"""The pipeline split (`vx.gpu.parallel_state.get_pp_indices`): vLLM's, stage by stage; and
how far the boundary moves on a step that hands off (`shift_layers`)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from vx.gpu.parallel_state import Grid, get_pp_indices, shift_layers


@pytest.mark.parametrize(
    ("layers", "pp", "sizes"),
    [(2, 2, [1, 1]), (3, 2, [2, 1]), (16, 2, [8, 8]), (32, 3, [11, 11, 10]), (30, 4, [7, 8, 8, 7])],
)
def test_layers_split_as_vllm_splits_them(layers: int, pp: int, sizes: list[int]) -> None:
    ranges = [get_pp_indices(layers, r, pp) for r in range(pp)]
    assert [end - start for start, end in ranges] == sizes
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


@pytest.mark.parametrize(
    ("layers", "pp", "head", "sizes"),
    [
        (16, 2, 4.32, [10, 6]),  # Llama-3.2-1B: its 128,256 x 2,048 head weighs 4.3 layers
        (16, 4, 4.32, [5, 5, 5, 1]),
        (32, 2, 0.25, [16, 16]),  # a light head: even (a tie keeps the first stage lighter)
        (3, 2, 50.0, [2, 1]),  # a head heavier than every layer: the last stage keeps one
    ],
)
def test_the_lm_head_counts_as_layers(layers: int, pp: int, head: float, sizes: list[int]) -> None:
    ranges = [get_pp_indices(layers, r, pp, head) for r in range(pp)]
    assert [end - start for start, end in ranges] == sizes
    assert ranges[0][0] == 0 and ranges[-1][1] == layers


def test_llama_1b_head_weight() -> None:
    from vx.gpu.models.llama import LlamaForCausalLM, ModelArgs

    a = ModelArgs(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                  num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
                  max_position=2048, rope={}, qkv_bias=False, o_bias=False, mlp_bias=False,
                  tie_word_embeddings=True, sliding_window=None, hidden_act="silu")  # fmt: skip
    assert 4.3 < LlamaForCausalLM.pp_head_layers(a) < 4.4


def test_partition_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VX_PP_LAYER_PARTITION", "10,6")
    assert [get_pp_indices(16, r, 2) for r in range(2)] == [(0, 10), (10, 16)]
    monkeypatch.setenv("VX_PP_LAYER_PARTITION", "10,5")
    with pytest.raises(ValueError, match="summing to 16"):
        get_pp_indices(16, 0, 2)


@pytest.mark.parametrize(
    ("env", "hand_off", "layers", "pp", "shifts"),
    [
        ("1", "1", 16, 2, [1, 0]),  # the default: one layer, none after the last stage
        ("2", "1", 16, 4, [2, 2, 2, 0]),
        ("5", "1", 3, 2, [1, 0]),  # a stage keeps one layer of its own
        ("1", "1", 2, 2, [0, 0]),
        ("0", "1", 16, 2, [0, 0]),
        ("1", "", 16, 2, [0, 0]),  # nothing hands off: nothing shifts
    ],
)
def test_shift_layers(
    monkeypatch: pytest.MonkeyPatch, env: str, hand_off: str, layers: int, pp: int,
    shifts: list[int],
) -> None:
    monkeypatch.setenv("VX_PP_SHIFT_LAYERS", env)
    monkeypatch.setenv("VX_PP_HAND_OFF_TOKENS", hand_off)
    assert [shift_layers(layers, r, pp) for r in range(pp)] == shifts
    assert shift_layers(layers, -1, pp) == 0  # the first stage has no stage before


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        get_pp_indices(2, 0, 3)


def test_grid_ranks_and_driver() -> None:
    g = Grid(tp_size=2, pp_size=2, tp_rank=1, pp_rank=1)
    assert (g.rank, g.world_size, g.driver_rank) == (3, 4, 2)
    assert g.is_last_stage and not g.is_first_stage
