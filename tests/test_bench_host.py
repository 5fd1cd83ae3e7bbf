"""eval/bench_host.py: each cache decoded in rounds beside DynamicCache, the two blocks of a round swapped every round,
and its ratio the median of the rounds' ratios (what lets a busy machine's slow spells cancel)."""

from __future__ import annotations

from pathlib import Path

EVAL = Path(__file__).resolve().parents[1] / "eval"


def test_rounds_alternate_and_a_slow_spell_cancels_in_the_median(monkeypatch):
    monkeypatch.syspath_prepend(str(EVAL))
    import bench_host

    # A fake clock that decoding advances: 1 s a step for DynamicCache's cache, 2 s for the cache's, times the load of
    # the block (blocks in the order they run: round 1 all slow, round 2's second block alone five times slower).
    load = iter([1, 1, 10, 10, 1, 5, 1, 1])
    now, order, blocks = [0.0], [], {}

    def prefilled(model, spec, prompt, steps):
        return spec, "token"

    def decode(model, cache, token):
        block = len(order) // 2  # two steps a block
        if block not in blocks:
            blocks[block] = next(load)
        factor = blocks[block]
        order.append(cache)
        now[0] += (1.0 if cache == "base" else 2.0) * factor
        return token

    monkeypatch.setattr(bench_host, "prefilled", prefilled)
    monkeypatch.setattr(bench_host, "decode", decode)
    monkeypatch.setattr(bench_host, "CLOCK", lambda: now[0])
    rounds = bench_host.paired_rounds(None, "base", "cache", None, steps=8, round_steps=2)

    # ABBA: DynamicCache's block first in even rounds, the cache's first in odd ones.
    base, cache = ["base"] * 2, ["cache"] * 2
    assert order == base + cache + cache + base + base + cache + cache + base
    ratios = [r["cache"][0] / r["base"][0] for r in rounds]
    assert ratios == [2.0, 2.0, 10.0, 2.0]  # the slow round cancels; the split one does not
    q1, median, q3 = bench_host._quartiles(ratios)
    assert median == 2.0 and q1 == 2.0 and q3 == 4.0
    assert sum(ratios) / len(ratios) == 4.0  # (a mean would take the split round in)
