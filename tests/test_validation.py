"""Bad input gets an error that names the parameter and what is allowed."""

import re

import pytest
import torch

import hvd_compress
import hvd_compress.pt as hc
from hvd_compress.registry import resolve
from hvd_compress.validation import (
    HOROVOD_DEFAULTS,
    check_bool,
    check_horovod_defaults,
    check_two_level_process_set,
)

from .horovod_keywords import NOT_DEFAULT


def test_unknown_codec_name_lists_the_choices():
    names = ", ".join(repr(name) for name in sorted(hvd_compress.CODECS))
    with pytest.raises(ValueError, match=rf"compression must be one of \[{names}\]"):
        resolve("ternary")


def test_codec_specs_with_hyperparameters():
    assert resolve("ef-sign:max_block_size=256", hc.CODECS) == hc.BlockSign(max_block_size=256)
    assert resolve("qsgd:bits=2:wire='elias'") == hvd_compress.QSGD(bits=2, wire="elias")
    with pytest.raises(
        ValueError, match="ef-sign has no hyperparameter blocks; it takes max_block_size"
    ):
        resolve("ef-sign:blocks=4")
    with pytest.raises(ValueError, match="name=value items .* got 'max_block_size'"):
        resolve("ef-sign:max_block_size")
    with pytest.raises(ValueError, match="got 'bits=two'"):
        resolve("qsgd:bits=two")
    with pytest.raises(ValueError, match="max_block_size must be >= 1"):
        resolve("ef-sign:max_block_size=0")


def test_horovods_own_compressors_are_the_codecs_of_the_same_name():
    import horovod.torch as hvd

    assert resolve(hvd.Compression.none, hc.CODECS) == hc.NoneCodec()
    assert resolve(hvd.Compression.fp16, hc.CODECS) == hc.FP16()
    with pytest.raises(TypeError, match="codec instance or hvd.Compression.none / .fp16, got"):
        resolve(object, hc.CODECS)


def test_negative_clip():
    with pytest.raises(ValueError, match=r"clip \(c\) must be >= 0"):
        hvd_compress.TernGrad(clip=-1)
    with pytest.raises(TypeError, match="clip"):
        hc.TernGrad(clip="2.5")
    with pytest.raises(ValueError, match="finite"):
        hc.TernGrad(clip=float("nan"))


def test_negative_min_size():
    with pytest.raises(ValueError, match="min_size must be >= 0"):
        hc.TernGrad(min_size=-1)
    with pytest.raises(TypeError, match="min_size must be an integer"):
        hc.TernGrad(min_size=1.5)


def test_a_flag_must_be_a_bool():
    assert check_bool("Wrapper", "scale_local_gradients", False) is False
    for value in (1, "yes", None):
        with pytest.raises(TypeError, match=r"^Wrapper: scale_local_gradients must be True or"):
            check_bool("Wrapper", "scale_local_gradients", value)


def test_wrapping_something_that_is_not_an_optimizer():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        hc.DistributedOptimizer(model, compression="terngrad")


def test_two_way_codec_refuses_to_run_without_error_feedback():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(
        ValueError,
        match="ef-sign compresses on the workers and again on the "
        "server.*cannot run with error_feedback=False",
    ):
        hc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), compression="ef-sign", error_feedback=False
        )


def test_the_pytorch_port_has_every_codec_of_the_registry_by_its_name():
    # The TensorFlow port builds its list the same way (``registry.port_codecs``).
    assert list(hc.CODECS) == list(hvd_compress.registry.CODECS)
    for name, cls in hc.CODECS.items():
        assert cls.name == name and issubclass(cls, hvd_compress.registry.CODECS[name])


def test_codecs_are_rebuilt_across_ports_and_compare_by_value():
    port = resolve(hvd_compress.TernGrad(clip=1.5), hc.CODECS)
    assert isinstance(port, hc.TernGrad) and port == hc.TernGrad(clip=1.5)
    assert hc.TernGrad(clip=1.5) != hc.TernGrad(clip=2.5)
    assert resolve(None, hc.CODECS) == hc.NoneCodec()
    with pytest.raises(TypeError, match="codec name"):
        resolve(3, hc.CODECS)


def test_every_hyperparameter_is_documented():
    for cls in hvd_compress.CODECS.values():
        for name in hvd_compress.resolve(cls.name).params():
            documented = "\n".join([cls.__doc__ or "", hvd_compress.Codec.__doc__])
            assert f"{name} (" in documented, f"{cls.__name__} does not document {name}"


@pytest.mark.parametrize("keyword", sorted(HOROVOD_DEFAULTS))
def test_horovod_keywords_are_taken_at_their_default_and_refused_otherwise(keyword):
    default, why, instead = HOROVOD_DEFAULTS[keyword]
    check_horovod_defaults("Wrapper", **{keyword: default})
    with pytest.raises(
        ValueError,
        match=rf"^Wrapper: {keyword}=.* is not supported "
        rf"\({re.escape(why)}\); {re.escape(instead)}, or "
        rf"leave it at",
    ):
        check_horovod_defaults("Wrapper", **{keyword: NOT_DEFAULT[keyword]})


@pytest.mark.parametrize("keyword", ["num_groups", "groups"])
def test_pytorch_optimizer_refuses_grouping(keyword):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=f"DistributedOptimizer: {keyword}="):
        hc.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), **{keyword: NOT_DEFAULT[keyword]}
        )


def test_two_level_runs_on_the_global_process_set_only():
    check_two_level_process_set(True)
    with pytest.raises(ValueError, match="exchange='two-level'.*global process set only"):
        check_two_level_process_set(False)
