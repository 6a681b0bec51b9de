"""The alpha-beta model's all-reduce times, against the formula worked by hand."""

import pytest

from benchmarks import scaling_model as model

LINK = model.Link("test link", bus_gb_s=100.0, alpha_us=10.0)
MESSAGE = 256 * model.MIB


def test_a_compressed_all_reduce_counts_each_ops_bytes_from_the_wire_ratio():
    """Two-shot at TP=2: the wire moves r * M, and compress, requantize and decode move
    (2 + w), w (1 + 1/k) and (w + 2) bytes an element, w = 2r."""
    codec = model.Codec("INT4-like", wire_ratio=0.25, compress_tb_s=1.0, requantize_tb_s=2.0, decompress_tb_s=4.0)
    elements = MESSAGE / 2
    wire = 0.25 * MESSAGE / 100e9 + 2 * 10e-6
    codec_s = 2.5 * elements / 1e12 + 0.5 * 1.5 * elements / 2e12 + 2.5 * elements / 4e12
    assert model.allreduce_taco_s(MESSAGE, 2, LINK, codec) == pytest.approx(wire + codec_s, rel=1e-12)
    assert model.allreduce_bf16_s(MESSAGE, 2, LINK) == pytest.approx(MESSAGE / 100e9 + 2 * 10e-6, rel=1e-12)


def test_tp2_messages_time_plain_and_every_codec_on_every_link():
    """One bf16 row and one row per codec for each link; fewer wire bytes at the same
    codec speed take less time."""
    codecs = [model.Codec(f"r{r}", r, 3.0, 3.0, 3.0) for r in (0.5, 0.25)]
    rows = model.tp2_messages([LINK, model.Link("slow", 25.0, 10.0)], codecs)
    assert [(row["link"], row["spec"]) for row in rows] == [
        (link, spec) for link in ("test link", "slow") for spec in ("bf16", "r0.5", "r0.25")
    ]
    for link in ("test link", "slow"):
        bf16, half, quarter = (row["ms"] for row in rows if row["link"] == link)
        assert bf16 > half > quarter > 0
