"""The FP8 recipes demo runs as a user runs it: one activation and one weight through each of
the five recipes (format, tiles, scales, codes, errors within the bound, error maps), then the
main job in fp32, bf16 and fp8 under each recipe with its loss table, and the OK line. About
3 s at 20 steps (the default 200 take about 30 s)."""

from minidist.memory.fp8_recipes import RECIPES
from tests.helpers import run_demo


def test_fp8_recipes_demo_shows_each_recipe_and_the_loss_table():
    rc, out = run_demo("33_fp8_recipes.py", "--steps", "20", "--seeds", "1")
    text = "\n".join(out)
    assert rc == 0 and out[0].startswith("demo 33 · FP8 recipes: "), text
    for name in RECIPES:                    # per tensor: a row of codes, a row of errors
        rows = [line.split() for line in out if line.startswith(f"   {name} ")]
        assert [r[1] for r in rows if r[1] in ("E4M3", "E5M2")] == ["E4M3", "E4M3"], text
        assert [r[-1] for r in rows if r[-1] in ("yes", "NO")] == ["yes", "yes"], text
        assert sum(line.startswith(f"   fp8 {name} ") for line in out) == 1, text
    assert "   mxfp8      E4M3  1 x 32 (32)       X = 2^e, e: -7 -5 -7 -127" in text
    assert "   blockwise  E4M3  128 x 128 (4)" in text
    assert "   |########| |########| |-------=| |--------| |------==|" in text   # the quiet row
    assert ("   run                GEMM inputs (a/w/g)  final loss      gap  within 1%  "
            "|gap| / σ     s") in text
    assert "   bf16, seed 1 " in text
    assert out[-2].startswith("OK: every element of 10 quantisations within its recipe's "
                              "bound"), text
    assert out[-1].startswith("measured, not checked: "), text
