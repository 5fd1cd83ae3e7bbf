"""Knorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"), as kvpress's
`KnormPress`: a key with a small L2 norm draws attention, so the cache keeps the lowest-norm keys.

Importing this file registers the policy: `EvictingCache(config, "knorm", budget=256)`, or the spec `knorm:256`
(`knorm:20%:bits=int4`, `knorm:256:compress=always:compile=on`). A token's score depends on its key alone, so it is
computed once, as the token arrives (`per_token`), from the key as attention reads it (decoded on quantized slots).
"""

from hf_kvplus import Needs, ScoredPolicy


class KnormPolicy(ScoredPolicy, name="knorm"):
    """Per KV head, the `budget` keys of lowest L2 norm (after the `sinks` first and `recent` newest tokens)."""

    needs = Needs(keys=True, per_token=True)
    compileable = True

    def score(self, view):
        return -view.keys.float().norm(dim=-1)
