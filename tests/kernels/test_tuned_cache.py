"""The tuned-config cache the launchers read (coreattn/kernels/tuned_cache.py) and the pick order in
kernels/configs/pick.py: forced > tuned (CUDA) > shipped; a round trip through a file, GQA fallback, and
each way a file or entry is ignored with one warning naming the file. No GPU: the device key is
faked, and lookups run against ``torch.device("cuda", 0)`` objects (which need no CUDA)."""

import json
import warnings

import pytest
import torch

from coreattn.kernels import tuned_cache
from coreattn.kernels.configs import dense, pick
from coreattn.kernels.configs.base import AttnConfig
from coreattn.kernels.configs.pick import forced_configs, pick_config, record_configs, tuned_fallback
from coreattn.kernels.configs.targets import FP_FUSION
from coreattn.kernels.tuned_cache import DeviceKey, KernelClass, TunedConfigWarning

KEY = DeviceKey("NVIDIA H100 80GB HBM3", "9.0", "3.9.0", "0.1.0")
CUDA = torch.device("cuda", 0)
CLS = KernelClass(128, 128, "bf16", causal=True)
SHIPPED = AttnConfig(128, 64, 8, 3, 255, fp_fusion=True)
TUNED = AttnConfig(64, 64, 4, 3, 255, tma=True)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty user cache directory and no shipped files; the process is ``KEY``'s."""
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    user.mkdir()
    shipped.mkdir()
    monkeypatch.setenv(tuned_cache.ENV_CACHE, str(user))
    monkeypatch.setattr(tuned_cache, "PACKAGE_DIR", shipped)
    monkeypatch.setattr(tuned_cache, "device_key", lambda device: KEY)
    tuned_cache.reload()
    yield user, shipped
    tuned_cache.reload()


def _entry(kernel="fwd", cls=CLS, cfg=TUNED):
    return {"kernel": kernel, "class": cls.for_kernel(kernel).id, "config": tuned_cache.config_to_json(cfg)}


def _write(path, key=KEY, entries=None):
    tuned_cache.write(path, key, "sm90", [_entry()] if entries is None else entries)
    tuned_cache.reload()
    return path


def _warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught if issubclass(w.category, TunedConfigWarning)]


def test_class_ids_round_trip_and_kernels_see_only_their_features():
    cls = KernelClass(192, 128, "bf16", True, True, ("dropout", "sink"))
    assert cls.id == "hdim192x128-bf16-causal-gqa-dropout-sink"
    assert KernelClass.parse(cls.id) == cls
    assert cls.for_kernel("dkdv").id == "hdim192x128-bf16-causal-gqa-dropout"
    assert cls.for_kernel("preprocess").id == "hdim192x128-bf16-full"
    for bad in ("hdim128-bf16-causal", "hdim128x128-bf16-causal-sink-dropout", "hdim1x1-fp8-full"):
        with pytest.raises(ValueError):
            KernelClass.parse(bad)


def test_launch_class_of_tensors():
    q, v = torch.empty(3, 8, 192, dtype=torch.bfloat16), torch.empty(3, 2, 128, dtype=torch.bfloat16)
    cls = tuned_cache.launch_class(q, v, -1, 0, heads_kv=2, dropout=True, max_logit=True)
    assert cls == KernelClass(192, 128, "bf16", True, True, ("dropout", "max_logit"))
    assert not tuned_cache.launch_class(q, v, -1, -1, heads_kv=8).causal


def test_round_trip_and_lookup(cache):
    path = _write(tuned_cache.user_cache_file(KEY))
    assert path.parent == cache[0] and path.name == "nvidia-h100-80gb-hbm3_cc90_triton-3.9.0_coreattn-0.1.0.json"
    read = tuned_cache.read(path)
    assert read.key == KEY and read.entries == {("fwd", CLS.id): TUNED}
    hit = tuned_cache.lookup(CUDA, "fwd", CLS)
    assert hit.config == TUNED and hit.path == path
    assert tuned_cache.lookup(CUDA, "fwd", CLS._replace(gqa=True)).config == TUNED  # GQA falls back to the MHA entry
    assert tuned_cache.lookup(CUDA, "dq", CLS) is None
    assert tuned_cache.lookup(CUDA, "fwd", CLS._replace(causal=False)) is None  # the mask is part of the class
    assert tuned_cache.lookup(CUDA, "fwd", CLS._replace(features=("dropout",))) is None


def test_pick_order_forced_then_tuned_then_shipped(cache):
    _write(tuned_cache.user_cache_file(KEY))
    with record_configs() as uses:
        got = pick_config("fwd", CUDA, "sm90", CLS, SHIPPED)
    assert got == TUNED._replace(fp_fusion=FP_FUSION)  # launches set fp fusion whatever the file says
    assert uses[("fwd", CLS.id)].source == f"tuned: {tuned_cache.user_cache_file(KEY)}"
    forced = AttnConfig(32, 32, 4, 2)
    with forced_configs(fwd=forced), record_configs() as uses:
        assert pick_config("fwd", CUDA, "sm90", CLS, SHIPPED) == forced
    assert uses[("fwd", CLS.id)].source == "forced by the tuner"
    assert pick_config("dq", CUDA, "sm90", CLS, SHIPPED) == SHIPPED
    assert pick_config("fwd", torch.device("cpu"), "sm90", CLS, SHIPPED) == SHIPPED  # emulated compiles: no cache
    assert pick_config("fwd", CUDA, "sm90", None, SHIPPED) == SHIPPED  # no class, no lookup
    with pytest.raises(ValueError, match="unknown kernels"):
        with forced_configs(bwd=forced):
            pass


def test_user_cache_over_shipped_files_and_other_gpus_skipped_silently(cache):
    user, shipped = cache
    other = AttnConfig(128, 32, 8, 2, 255)
    _write(shipped / "h100.json", entries=[_entry(cfg=other), _entry("dq", cfg=other)])
    _write(shipped / "b200.json", key=KEY._replace(gpu="NVIDIA B200", capability="10.0"))
    _write(user / tuned_cache.file_name(KEY))
    hits, caught = _warnings(lambda: (tuned_cache.lookup(CUDA, "fwd", CLS), tuned_cache.lookup(CUDA, "dq", CLS)))
    assert hits[0].config == TUNED and hits[1].config == other and hits[1].path == shipped / "h100.json"
    assert caught == []


def test_file_for_another_gpu_or_triton_is_ignored_with_one_warning(cache, tmp_path, monkeypatch):
    path = _write(tmp_path / "mine.json", key=KEY._replace(triton="3.8.0"))
    monkeypatch.setenv(tuned_cache.ENV_CACHE, str(path))
    tuned_cache.reload()
    hit, caught = _warnings(lambda: [tuned_cache.lookup(CUDA, "fwd", CLS) for _ in range(3)])
    assert hit == [None] * 3
    assert len(caught) == 1 and str(path) in caught[0] and "triton 3.8.0" in caught[0]
    path = _write(tmp_path / "mine.json", key=KEY._replace(gpu="NVIDIA A100-SXM4-80GB", capability="8.0"))
    hit, caught = _warnings(lambda: tuned_cache.lookup(CUDA, "fwd", CLS))
    assert hit is None and len(caught) == 1 and "NVIDIA A100-SXM4-80GB" in caught[0]


@pytest.fixture
def real_versions(tmp_path, monkeypatch):
    """A faked H100 whose device key takes this process's real Triton and coreattn versions
    (``tuned_cache.versions()``, as on a GPU); an empty user cache directory and no shipped files."""
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    user.mkdir()
    shipped.mkdir()
    monkeypatch.setenv(tuned_cache.ENV_CACHE, str(user))
    monkeypatch.setattr(tuned_cache, "PACKAGE_DIR", shipped)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: KEY.gpu)
    tuned_cache._device_key.cache_clear()
    tuned_cache.reload()
    yield user, shipped
    tuned_cache._device_key.cache_clear()
    tuned_cache.reload()


def test_file_from_another_triton_is_ignored_with_one_warning_under_this_triton(real_versions, tmp_path, monkeypatch):
    import triton

    from coreattn.kernels.versions import TESTED_TRITON

    user, shipped = real_versions
    key = tuned_cache.device_key(CUDA)
    assert key.triton == triton.__version__ and key.gpu == KEY.gpu
    other = next(v for v in (*TESTED_TRITON, "3.5.0") if v != triton.__version__)  # another release users have
    # the cache directory: this GPU's file from the other Triton is stale, named once, never used
    stale = _write(user / tuned_cache.file_name(key._replace(triton=other)), key=key._replace(triton=other))
    _write(shipped / "h100-other-triton.json", key=key._replace(triton=other))  # a package file: skipped silently
    hits, caught = _warnings(lambda: [tuned_cache.lookup(CUDA, "fwd", CLS) for _ in range(3)])
    assert hits == [None] * 3
    assert len(caught) == 1 and str(stale) in caught[0] and f"triton {triton.__version__}" in caught[0]
    # this Triton's own file beside it is used; the stale one is still not
    _write(user / tuned_cache.file_name(key), key=key)
    hit, caught = _warnings(lambda: tuned_cache.lookup(CUDA, "fwd", CLS))
    assert hit.config == TUNED and hit.path == user / tuned_cache.file_name(key)
    assert len(caught) == 1 and str(stale) in caught[0]  # named again: the write above reloaded the files
    # a file named by COREATTN_TUNE_CACHE, made under the other Triton: one warning naming both versions
    path = _write(tmp_path / "theirs.json", key=key._replace(triton=other))
    monkeypatch.setenv(tuned_cache.ENV_CACHE, str(path))
    tuned_cache.reload()
    hits, caught = _warnings(lambda: [tuned_cache.lookup(CUDA, kernel, CLS) for kernel in ("fwd", "dq", "fwd")])
    assert hits == [None] * 3
    assert len(caught) == 1 and str(path) in caught[0]
    assert f"triton {other}" in caught[0] and f"triton {triton.__version__}" in caught[0]


def test_stale_file_of_this_gpu_in_the_cache_directory_is_named(cache):
    user, _ = cache
    stale = _write(user / tuned_cache.file_name(KEY._replace(coreattn="0.0.9")), key=KEY._replace(coreattn="0.0.9"))
    _write(user / tuned_cache.file_name(KEY._replace(gpu="NVIDIA B200", capability="10.0")))  # another GPU's: silent
    hit, caught = _warnings(lambda: tuned_cache.lookup(CUDA, "fwd", CLS))
    assert hit is None and len(caught) == 1 and str(stale) in caught[0] and "python -m coreattn.tune" in caught[0]


@pytest.mark.parametrize("text", ["{not json", json.dumps({"format": "something else"}),
                                  json.dumps({"format": tuned_cache.FORMAT, "key": {"gpu": "x"}, "entries": []})],
                         ids=["not-json", "wrong-format", "bad-key"])
def test_corrupt_file_is_ignored_with_one_warning(cache, text):
    path = cache[0] / tuned_cache.file_name(KEY)
    path.write_text(text)
    hit, caught = _warnings(lambda: [tuned_cache.lookup(CUDA, "fwd", CLS), tuned_cache.lookup(CUDA, "dq", CLS)])
    assert hit == [None, None] and len(caught) == 1 and str(path) in caught[0]


def test_malformed_entries_are_dropped_and_the_rest_kept(cache):
    bad_cfg = dict(tuned_cache.config_to_json(TUNED), block_m=48)
    entries = [_entry(), {"kernel": "dq", "class": CLS.id, "config": bad_cfg},
               {"kernel": "bwd", "class": CLS.id, "config": tuned_cache.config_to_json(TUNED)},
               {"kernel": "dkdv", "class": CLS._replace(features=("sink",)).id,
                "config": tuned_cache.config_to_json(TUNED)}]
    path = tuned_cache.user_cache_file(KEY)
    path.write_text(json.dumps({"format": tuned_cache.FORMAT, "key": KEY._asdict(), "entries": entries}))
    hit, caught = _warnings(lambda: (tuned_cache.lookup(CUDA, "fwd", CLS), tuned_cache.lookup(CUDA, "dq", CLS)))
    assert hit[0].config == TUNED and hit[1] is None
    assert len(caught) == 1 and str(path) in caught[0] and "3 malformed entries" in caught[0]


def test_config_json_validation():
    assert tuned_cache.config_from_json(tuned_cache.config_to_json(TUNED)) == TUNED
    assert tuned_cache.config_from_json({"block_m": 32, "block_n": 0, "num_warps": 4}).num_stages is None
    for bad in ({"block_m": 32}, {"block_m": 32, "block_n": 16, "num_warps": 3},
                {"block_m": 8, "block_n": 16, "num_warps": 4}, dict(tuned_cache.config_to_json(TUNED), tma="yes"),
                dict(tuned_cache.config_to_json(TUNED), extra=1), [1, 2]):
        with pytest.raises(ValueError):
            tuned_cache.config_from_json(bad)


def test_an_entry_that_fails_to_compile_falls_back_to_shipped_with_one_warning(cache):
    from triton.runtime.errors import OutOfResources

    path = _write(tuned_cache.user_cache_file(KEY))
    ran = []

    @tuned_fallback
    def launcher(fail_with=None):
        cfg = pick_config("fwd", CUDA, "sm90", CLS, SHIPPED)
        ran.append(cfg)
        if cfg != SHIPPED and fail_with is not None:
            raise fail_with
        return cfg

    (first, second), caught = _warnings(lambda: (launcher(OutOfResources(300_000, 232_448, "shared memory")),
                                                 launcher(OutOfResources(1, 1, "shared memory"))))
    assert first == second == SHIPPED and ran == [TUNED._replace(fp_fusion=True), SHIPPED, SHIPPED]
    assert len(caught) == 1 and str(path) in caught[0] and "failed to compile" in caught[0]
    assert tuned_cache.lookup(CUDA, "fwd", CLS) is None  # dropped for the rest of the process


def test_other_failures_propagate_and_keep_the_entry(cache):
    _write(tuned_cache.user_cache_file(KEY))

    @tuned_fallback
    def launcher():
        pick_config("fwd", CUDA, "sm90", CLS, SHIPPED)
        raise ValueError("a bad argument, not a config")

    with pytest.raises(ValueError, match="bad argument"):
        launcher()
    assert tuned_cache.lookup(CUDA, "fwd", CLS).config == TUNED


def test_forced_configs_that_fail_propagate(cache):
    from triton.runtime.errors import OutOfResources

    @tuned_fallback
    def launcher():
        pick_config("fwd", CUDA, "sm90", CLS, SHIPPED)
        raise OutOfResources(1, 0, "shared memory")

    with forced_configs(fwd=TUNED), pytest.raises(OutOfResources):
        launcher()


def test_launch_options_set_fp_fusion_on_cuda_only():
    assert dense.shipped_config("sm90", "fwd", 128, 128).launch()["enable_fp_fusion"] is True
    assert dense.shipped_config("sm90", "preprocess", 128, 128).launch() == dict(num_warps=8, maxnreg=255,
                                                                                enable_fp_fusion=True)
    assert "enable_fp_fusion" not in dense.shipped_config("ascend", "fwd", 128, 128).launch()
    assert "enable_fp_fusion" not in dense.shipped_config("interpreter", "dq", 128, 128).launch()


@pytest.mark.interpreter_only("a CPU device's launch target is the interpreter only under TRITON_INTERPRET=1")
def test_interpreter_launches_pass_no_cuda_option():
    dev = torch.device("cpu")
    assert dense.preprocess_config(dev, 128, 128).launch() == {"num_warps": dense._INTERPRETER.num_warps}


def test_nested_recorders_each_see_their_launches():
    with record_configs() as outer:
        pick_config("dq", torch.device("cpu"), "sm90", CLS, SHIPPED)
        with record_configs() as inner:
            pick_config("dq", torch.device("cpu"), "sm90", CLS, SHIPPED)
        assert inner == outer
        pick_config("fwd", torch.device("cpu"), "sm90", CLS, SHIPPED)
    assert set(outer) == {("dq", CLS.id), ("fwd", CLS.id)} and set(inner) == {("dq", CLS.id)}
    assert pick._RECORDERS == []


def test_tuned_files_ship_as_package_data():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((tuned_cache.PACKAGE_DIR.parents[2] / "pyproject.toml").read_text())
    data = pyproject["tool"]["setuptools"]["package-data"]["coreattn.kernels"]
    assert f"{tuned_cache.PACKAGE_DIR.name}/*.json" in data
    for path in tuned_cache.PACKAGE_DIR.glob("*.json"):  # every contributed file is a valid one
        assert tuned_cache.read(path).entries, path
