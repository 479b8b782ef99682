"""The environment -> CommConfig mapping (one function; errors name the variable)."""

import pytest
import torch
from conftest import run_ranks

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


def test_codec_switches_are_part_of_the_config():
    """QCOMM_COMPILE and QCOMM_TRITON_WARPS are read once, into the group's frozen config;
    a bad value names the variable, a bad field the field. TRITON_INTERPRET stays a
    reading of how Triton was started."""
    from qcomm import config

    assert (CommConfig().compile, CommConfig().triton_warps) == (None, 0)
    assert comm_config_from_env({"QCOMM_COMPILE": "0"}).compile is False
    assert comm_config_from_env({"QCOMM_COMPILE": "1"}).compile is True
    assert comm_config_from_env({}, base=CommConfig(compile=False)).compile is False
    for raw, want in (("", 0), ("0", 0), ("4", 4), ("32", 32)):
        assert comm_config_from_env({"QCOMM_TRITON_WARPS": raw}).triton_warps == want
    assert comm_config_from_env({}, base=CommConfig(triton_warps=8)).triton_warps == 8
    for env in ({"QCOMM_COMPILE": "yes"}, {"QCOMM_TRITON_WARPS": "3"},
                {"QCOMM_TRITON_WARPS": "many"}, {"QCOMM_TRITON_WARPS": "-4"}):
        (name,) = env
        with pytest.raises(ValueError, match=f"{name}={env[name]!r}"):
            comm_config_from_env(env)
    with pytest.raises(TypeError, match="CommConfig.compile must be a bool or None"):
        CommConfig(compile=0)
    with pytest.raises(TypeError, match="CommConfig.triton_warps must be an int"):
        CommConfig(triton_warps="4")
    with pytest.raises(TypeError, match="CommConfig.triton_warps must be an int"):
        CommConfig(triton_warps=True)
    with pytest.raises(ValueError, match="CommConfig.triton_warps must be 0"):
        CommConfig(triton_warps=3)
    assert {"QCOMM_COMPILE", "QCOMM_TRITON_WARPS"} <= set(config.VARIABLES)
    assert config.env_from_keys("compile=0,triton_warps=4") == {
        "QCOMM_COMPILE": "0", "QCOMM_TRITON_WARPS": "4"}
    assert not hasattr(config, "compile_enabled") and not hasattr(config, "triton_warps")
    assert config.triton_interpreted({"TRITON_INTERPRET": "1"})
    assert not config.triton_interpreted({})


def test_codec_options_and_the_direct_default(monkeypatch):
    """A group's codec keywords come from its config alone (named paths); a direct call
    that names none runs what the environment said at its first use, read once."""
    from qcomm import codec, config

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert codec.codec_options(CommConfig(compile=True), cpu) == {"impl": "torch", "warps": 0}
    assert codec.codec_options(CommConfig(compile=False), cpu) == {"impl": "eager", "warps": 0}
    assert codec.codec_options(CommConfig(compile=False, triton_warps=2), cuda) == {
        "impl": None, "warps": 2}
    assert codec._select_impl(cpu, "torch") == "torch"  # named: whatever the environment
    for bad in (3, -1, True, "4"):
        with pytest.raises(ValueError, match="warps must be 0"):
            codec.quantize(torch.ones(8), QuantConfig(bucket_size=8), impl="eager", warps=bad)

    config.env_config.cache_clear()
    try:
        monkeypatch.setenv("QCOMM_COMPILE", "0")
        assert codec._select_impl(cpu, None) == "eager"
        monkeypatch.setenv("QCOMM_COMPILE", "1")
        assert codec._select_impl(cpu, None) == "eager"  # read once per process
        config.env_config.cache_clear()
        assert codec._select_impl(cpu, None) == "torch"
        assert codec._select_impl(cuda, None) == "triton"
        # a config that leaves compile unset follows the process's variable, read once
        monkeypatch.setenv("QCOMM_COMPILE", "0")
        config.env_config.cache_clear()
        assert codec.codec_options(CommConfig(), cpu)["impl"] == "eager"
        assert codec.codec_options(CommConfig(compile=True), cpu)["impl"] == "torch"
    finally:
        config.env_config.cache_clear()


def _codec_paths_body(rank, world):
    """The paths and warps the codec is asked for by a group made from the environment
    (the workers' QCOMM_COMPILE=0) and by one given compile=True, triton_warps=4."""
    import torch.distributed as dist

    import qcomm
    from qcomm import codec

    real, seen = codec._launchers, set()

    def spy(path, warps=0):
        seen.add((path, warps))
        return real("eager")  # the same bytes on every path: no compile in the ranks

    codec._launchers = spy
    groups = {"env": qcomm.wrap(None),  # the QCOMM_* environment's config
              "config": qcomm.wrap(None, CommConfig(compile=True, triton_warps=4))}
    got = {}
    for name, group in groups.items():
        seen.clear()
        x = torch.randn(2 * 4096, generator=torch.Generator().manual_seed(rank))
        out = torch.empty(world * x.numel())
        dist.all_gather_into_tensor(out, x, group=group)
        dist.reduce_scatter_tensor(torch.empty(x.numel() // world), x, group=group)
        dist.all_reduce(x, group=group)
        got[name] = sorted(seen)
    return got


@pytest.mark.slow
def test_group_calls_take_the_groups_codec_switches():
    """Every codec call of a group runs the path and warps of the group's config, read
    at creation: eager where the environment said QCOMM_COMPILE=0 (the test workers),
    compiled with 4 warps where the config says so, in the same processes."""
    for got in run_ranks(_codec_paths_body, 2, backend="gloo"):
        assert got == {"env": [("eager", 0)], "config": [("torch", 4)]}


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


def test_bits_auto():
    """QCOMM_BITS=auto marks every kind auto, in the bits a number would give (QCOMM_BITS
    is not one: the base's, else 8); a kind's own number wins and is fixed; a kind's
    own auto takes QCOMM_BITS's number. CommConfig(auto=True) is every kind."""
    c = comm_config_from_env({"QCOMM_BITS": "auto"})
    assert c.auto == ("all_gather", "reduce_scatter", "all_reduce") == CommConfig(auto=True).auto
    assert c.all_gather == c.reduce_scatter == c.all_reduce == QuantConfig(bits=8)
    c = comm_config_from_env({"QCOMM_BITS": "auto", "QCOMM_AG_BITS": "4"})
    assert c.auto == ("reduce_scatter", "all_reduce") and c.all_gather.bits == 4
    c = comm_config_from_env({"QCOMM_BITS": "4", "QCOMM_RS_BITS": "AUTO"})
    assert c.auto == ("reduce_scatter",) and c.reduce_scatter.bits == c.all_gather.bits == 4
    c = comm_config_from_env({"QCOMM_BITS": "off", "QCOMM_AR_BITS": "auto"})
    assert c.auto == ("all_reduce",) and c.all_reduce.bits == 8 and c.all_gather is None
    base = CommConfig(auto=True, all_gather=QuantConfig(bits=2))
    assert comm_config_from_env({}, base=base).auto == base.auto
    assert comm_config_from_env({"QCOMM_AG_BITS": "auto"}, base=base).all_gather.bits == 2
    assert comm_config_from_env({"QCOMM_AG_BITS": "8"}, base=base).auto == (
        "reduce_scatter", "all_reduce")
    assert CommConfig(auto=False).auto == () and CommConfig(auto=["all_reduce"]).auto == (
        "all_reduce",)
    with pytest.raises(ValueError, match="CommConfig.auto"):
        CommConfig(auto=("all_to_all",))
    with pytest.raises(ValueError, match="QCOMM_BITS='automatic'"):
        comm_config_from_env({"QCOMM_BITS": "automatic"})
