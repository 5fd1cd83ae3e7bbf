"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"), as kvpress's `TOVAPress`: a token's score is the
attention the last query gives it, averaged over every head of the layer, so all KV heads keep the same tokens; the
newest token is kept (`recent=1`, as kvpress pads it with the largest score).

Importing this file registers the policy: `EvictingCache(config, "tova", budget=256)`, or the spec `tova:256`
(`tova:20%:bits=int4`, `tova:256:compress=always:compile=on`: each decode step then keeps what its own query reads).
"""

from hf_kvplus import Mass, Needs, ScoredPolicy, Setting


class TOVAPolicy(ScoredPolicy, name="tova"):
    """Per layer, the `budget` tokens the last query of each forward attends to most, the same in every KV head."""

    settings = (Setting("sinks", int, 0, minimum=0), Setting("recent", int, 1, minimum=0),
                Setting("compress", str, "prefill", choices=("always", "prefill")))
    # The last query's mass per KV head (summed over its query group), replacing what earlier forwards gave.
    needs = Needs(mass=Mass(queries=1, reduce="sum", join="replace"))
    compileable = True

    def score(self, view):
        # The mean over all query heads, up to a constant: the sum over KV heads of their groups' sums.
        return view.mass.sum(dim=1, keepdim=True).expand_as(view.mass)
