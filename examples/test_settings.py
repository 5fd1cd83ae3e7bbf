"""The example policies' settings, as they declare them, are checked by spec strings and constructors alike: a value
out of its bounds or choices, an unknown option, or a budget the sinks and recent window fill is a `ConfigError` that
names the option and the numbers."""

import keydiff
import knorm  # noqa: F401 - registers "knorm"
import pytest
import tova  # noqa: F401 - registers "tova"

from hf_kvplus import ConfigError, EvictingCache
from hf_kvplus.specs import parse_cache_spec


@pytest.mark.parametrize("text, match", [("knorm:8:recent=-1", "recent in cache spec .* must be >= 0, got -1"),
                                         ("knorm:8:norm=2", r"unknown options \['norm'\]"),
                                         ("knorm:8:recent=8", r"sinks=0 \+ recent=8 .* budget=8"),
                                         ("tova:8:recent=x", "recent in cache spec .* must be an integer, got 'x'"),
                                         ("tova:8:compress=never", "compress must be one of"),
                                         ("tova:8:compile=on", "compileable=True needs compress='always'"),
                                         ("keydiff", r"expected keydiff:<budget>, e\.g\. keydiff:1024"),
                                         ("keydiff:0", "must hold at least 1 token")])
def test_bad_specs_are_refused_with_the_numbers(model, text, match):
    with pytest.raises(ConfigError, match=match):
        parse_cache_spec(text).build(model.config)


def test_constructors_check_the_same_bounds(model):
    with pytest.raises(ConfigError, match="KeyDiffPolicy: sinks must be >= 0, got sinks=-2"):
        EvictingCache(model.config, "keydiff", budget=8, sinks=-2)
    with pytest.raises(ConfigError, match=r"KeyDiffPolicy takes no setting \['window'\]"):
        EvictingCache(model.config, keydiff.KeyDiffPolicy, budget=8, window=2)
    with pytest.raises(ConfigError, match=r"settings \['recent'\] are a policy class's"):
        EvictingCache(model.config, keydiff.KeyDiffPolicy(10), recent=2)
