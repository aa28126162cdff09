"""The expert-parallel demo runs as a user runs it: one MoE layer on 2 ranks with its drops,
counts, dispatch and combine, outputs and bytes equal to the unsharded layer and the formula;
a dp=2, ep=2 training run whose losses equal the 1-process run; an OK line."""

import pytest

from tests.helpers import run_demo

pytestmark = pytest.mark.multiproc
DEMO = "13_expert_parallel.py"


def _ok(*args: str) -> list[str]:
    rc, out = run_demo(DEMO, *args)
    assert rc == 0 and out[-1].startswith("OK: ep=2 layer = unsharded MoE, bytes = take_traffic, "
                                          "dp+ep losses = 1 process "), "\n".join(out)
    assert out[0].startswith("demo 13 · expert parallel · E=4, top-2, ep=2: "), out[0]
    return out


# both slow (~1-2 s each): the default run keeps only the cheapest demos
@pytest.mark.slow
def test_expert_demo_default_shows_drops_the_all_to_alls_and_matches_the_references():
    out = _ok()
    text = "\n".join(out)
    for line in (
            "capacity per expert and routing group of 4 tokens = min(G, ceil(1.0 K G / E)) = 2;",
            "a group admits all 1st choices, then all 2nd choices, ...",
            "  rank 0 counts e0..e3 [4, 4, 2, 4] -> rank 0 gets [4, 4], rank 1 gets [2, 4]",
            "  rank 1 counts e0..e3 [4, 3, 4, 3] -> rank 0 gets [4, 3], rank 1 gets [4, 3]",
            "  rank 0 to r0 (stays): e0[t2 t3 t5 t6] e1[t1 t0 t4 t7] | to r1: e2[t2 t5] "
            "e3[t0 t1 t7 t4]",
            "  rank 1 e2 <- r0:t2 r0:t5 r1:t2 r1:t1 r1:t6 r1:t7",
            "  rank 0 gets back 8 rows from r0, 6 rows from r1",
            "  rank 1 gets back 7 rows from r0, 7 rows from r1"):
        assert line in out, f"missing {line!r}\n{text}"
    # a later token loses its 2nd choice to an earlier token's 1st and 2nd choices
    assert any(line.startswith("  t6: ") and line.endswith(
        "DROPPED: e3 full in group 1: t7 (choice 1), t4 (choice 2)") for line in out), text
    assert sum(" DROPPED: " in line for line in out) == 4
    for r, (S, R) in enumerate(((6, 7), (7, 6))):
        i = next(i for i, line in enumerate(out)
                 if line.startswith(f"rank {r}: out vs unsharded MoE max |Δ| = "))
        assert out[i + 1] == ("  ep bytes sent, fwd + bwd: 1264, take_traffic 2 "
                              f"(S={S} + R={R}) C 8 + (W-1) E/W 8 = 1264"), text
    assert sum(line.startswith("step ") and "| loss dp+ep " in line for line in out) == 6
    heat = [line for line in out if line.startswith("    expert ")]
    assert len(heat) == 2 * 4, heat                 # 2 layers x 4 experts, one char a step:
    assert all(set(line[19:25]) <= set(" .:-=+*#%@") and line[25] == " " for line in heat), heat


@pytest.mark.slow
def test_expert_demo_without_drops_and_with_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "routing.png"
    out = _ok("--capacity-factor", "2.0", "--steps", "2", "--png", str(path))
    assert out[3].endswith("= min(G, ceil(2.0 K G / E)) = 4;"), out[3]
    assert not any("DROPPED" in line for line in out)
    assert f"heatmap written to {path}" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


BALANCING = "30_moe_balancing.py"


def test_balancing_demo_short_run_shows_every_router_and_the_layout_s_biases():
    rc, out = run_demo(BALANCING, "--steps", "12", "--last", "4", "--layout-steps", "2")
    text = "\n".join(out)
    assert rc in (0, 1) and out[0].startswith("demo 30 · MoE balancing · E=8, top-2: "), text
    assert out[5].split() == ["token", "softmax", "sigmoid", "sigmoid,", "1", "group",
                              "expert", "choice"], text
    # expert choice: token t1 taken by all 4 experts, t2 by one only
    assert out[7].endswith("e0 0.23 e1 0.26 e2 0.26 e3 0.24") and out[8].endswith(
        "e0 0.51 e1 0.49   e0 0.27"), text
    assert sum(line.endswith("rank 0 = rank 1 = 1 process: True") for line in out) == 2, text
    assert out[-2].startswith(("OK: aux-loss-free max violation",
                               "NOT REACHED: aux-loss-free max violation")), text


@pytest.mark.slow
def test_balancing_demo_reaches_a_lower_max_violation_at_a_lower_loss(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "balance.png"
    rc, out = run_demo(BALANCING, "--png", str(path))
    text = "\n".join(out)
    assert rc == 0 and out[-2].startswith("OK: aux-loss-free max violation "), text
    assert f"plot written to {path}" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
