"""The environment -> CommConfig mapping (one function; errors name the variable)."""

import pytest

from qcomm import CommConfig, QuantConfig, comm_config_from_env


def test_defaults_follow_qsdp():
    c = comm_config_from_env({})
    assert c == CommConfig()
    for q in (c.all_gather, c.reduce_scatter, c.all_reduce):
        assert (q.bits, q.bucket_size, q.rounding) == (8, 1024, "stochastic")
    assert c.min_numel == 1024


def test_common_and_per_collective_settings():
    c = comm_config_from_env({
        "QCOMM_AG_BITS": "4", "QCOMM_RS_BITS": "off", "QCOMM_AR_BITS": "2",
        "QCOMM_BUCKET": "256", "QCOMM_AG_BUCKET": "128", "QCOMM_SCHEME": "nuq",
        "QCOMM_AG_ROUNDING": "nearest", "QCOMM_AR_NORM": "l2", "QCOMM_MIN_NUMEL": "0x10",
        "QCOMM_SEED": "7", "QCOMM_INNER": "gloo"})
    assert c.all_gather == QuantConfig(bits=4, bucket_size=128, scheme="nuq", rounding="nearest")
    assert c.reduce_scatter is None
    assert c.all_reduce == QuantConfig(bits=2, bucket_size=256, scheme="nuq", norm="l2")
    assert (c.min_numel, c.seed, c.inner) == (16, 7, "gloo")


@pytest.mark.parametrize("env, name", [
    ({"QCOMM_AG_BITS": "9"}, "QCOMM_AG_BITS"),
    ({"QCOMM_RS_BITS": "eight"}, "QCOMM_RS_BITS"),
    ({"QCOMM_BUCKET": "12"}, "QCOMM_BUCKET"),
    ({"QCOMM_BUCKET": "big"}, "QCOMM_BUCKET"),
    ({"QCOMM_AG_SCHEME": "qsgd"}, "QCOMM_AG_SCHEME"),
    ({"QCOMM_ROUNDING": "up"}, "QCOMM_ROUNDING"),
    ({"QCOMM_SEED": "x"}, "QCOMM_SEED"),
])
def test_bad_values_name_the_variable(env, name):
    with pytest.raises(ValueError, match=name):
        comm_config_from_env(env)


def test_process_wide_switches(monkeypatch):
    from qcomm import config

    assert config.compile_enabled({}) and not config.compile_enabled({"QCOMM_COMPILE": "0"})
    assert config.triton_interpreted({"TRITON_INTERPRET": "1"})
    assert not config.triton_interpreted({})
    for raw, want in (("", 0), ("4", 4)):
        monkeypatch.setenv("QCOMM_TRITON_WARPS", raw)
        config.triton_warps.cache_clear()
        assert config.triton_warps() == want
    for bad in ("3", "many"):
        monkeypatch.setenv("QCOMM_TRITON_WARPS", bad)
        config.triton_warps.cache_clear()
        with pytest.raises(ValueError, match="QCOMM_TRITON_WARPS"):
            config.triton_warps()
    config.triton_warps.cache_clear()


def test_async_switch_is_part_of_the_config():
    """QCOMM_ASYNC is read once, into the group's frozen config; a bad value names it."""
    assert CommConfig().asynchronous is True
    assert comm_config_from_env({"QCOMM_ASYNC": "0"}).asynchronous is False
    assert comm_config_from_env({"QCOMM_ASYNC": "1"}).asynchronous is True
    assert comm_config_from_env({}, base=CommConfig(asynchronous=False)).asynchronous is False
    with pytest.raises(ValueError, match="QCOMM_ASYNC='yes'"):
        comm_config_from_env({"QCOMM_ASYNC": "yes"})
    with pytest.raises(TypeError, match="asynchronous must be a bool"):
        CommConfig(asynchronous=0)


def test_common_bits_and_config_keys():
    """QCOMM_BITS sets all three collectives, a specific variable wins; a config written
    as keys is the environment it names (what the benchmarks' --config takes)."""
    c = comm_config_from_env({"QCOMM_BITS": "4", "QCOMM_RS_BITS": "8"})
    assert (c.all_gather.bits, c.reduce_scatter.bits, c.all_reduce.bits) == (4, 8, 4)
    c = comm_config_from_env({"QCOMM_BITS": "off", "QCOMM_AG_BITS": "2"})
    assert (c.all_gather.bits, c.reduce_scatter, c.all_reduce) == (2, None, None)

    from qcomm.config import env_from_keys

    env = env_from_keys("bits=4, scheme=nuq,AG_ROUNDING=nearest,async=0")
    assert env == {"QCOMM_BITS": "4", "QCOMM_SCHEME": "nuq", "QCOMM_AG_ROUNDING": "nearest",
                   "QCOMM_ASYNC": "0"}
    c = comm_config_from_env(env)
    assert c.all_gather == QuantConfig(bits=4, scheme="nuq", rounding="nearest")
    assert c.asynchronous is False
    assert comm_config_from_env(env_from_keys("exact")).all_gather is None
    with pytest.raises(ValueError, match="'colour=red' is not KEY=VALUE"):
        env_from_keys("bits=4,colour=red")
    with pytest.raises(ValueError, match="QCOMM_BITS='9'"):
        env_from_keys("bits=9")
