"""KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction"), as kvpress's `KeyDiffPress`: keys
most like the layer's average key carry the least, so a token's score is minus the cosine similarity of its key to the
mean of the held keys' unit vectors (per KV head).

Importing this file registers the policy: `EvictingCache(config, "keydiff", budget=256)`, or the spec `keydiff:256`
(`keydiff:20%:bits=int4`). The anchor moves with every key held, so the score reads all held keys at each eviction.
"""

import torch.nn.functional as F

from hf_kvplus import Needs, ScoredPolicy


class KeyDiffPolicy(ScoredPolicy, name="keydiff"):
    """Per KV head, the `budget` keys least similar (cosine) to the mean unit key of the held ones."""

    needs = Needs(keys=True)
    compileable = True

    def score(self, view):
        keys = view.keys.float()
        anchor = F.normalize(keys, p=2, dim=-1).mean(dim=2, keepdim=True)
        return -F.cosine_similarity(keys, anchor, dim=-1)
