"""The one argument binder (ops.binding), as the eager modules use it: the frontend's spec tests
(test_frontend.py) check the same rules with locations; here Python values and Python's errors."""

import pytest

from fusegen import eager


@pytest.mark.parametrize("make, error, message", [
    (lambda: eager.Linear(4, 8, True), TypeError, "Linear() takes 2 positional arguments but 3 were given; "
                                                  "pass bias, device, dtype, accumulate_into_main_grad by keyword"),
    (lambda: eager.RMSNorm(8, epsilon=1e-6), TypeError, "RMSNorm() got an unexpected keyword argument 'epsilon'"),
    (lambda: eager.Bias(8, size=8), TypeError, "Bias() got multiple values for argument 'size'; give it once"),
    (lambda: eager.LayerNorm(), TypeError, "LayerNorm() missing required argument 'normalized_shape'"),
    (lambda: eager.RMSNorm(8.5), ValueError, "argument 'normalized_shape' of RMSNorm must be an int or a non-empty tuple of ints, got float 8.5"),
    (lambda: eager.LayerNorm((7, -2)), ValueError, "argument 'normalized_shape' of LayerNorm must hold positive sizes"),
    (lambda: eager.ClampedSwiGLU(limit="7"), ValueError, "argument 'limit' of ClampedSwiGLU must be a number"),
    (lambda: eager.Linear(4, 8, bias=1), ValueError, "argument 'bias' of Linear must be True or False, got int 1"),
    (lambda: eager.RMSNorm(8, eps=0.0), ValueError, "argument 'eps' of RMSNorm must be positive"),
    (lambda: eager.ConstantScale(float("nan")), ValueError, "argument 'scale' of ConstantScale must be finite"),
])
def test_eager_calls_are_bound_like_specs(make, error, message):
    with pytest.raises(error) as info:
        make()
    assert message in str(info.value)


def test_defaults_and_conversion():
    assert eager.ClampedSwiGLU(alpha=2).args == {"glu_interleave_size": None, "limit": 7.0, "alpha": 2.0,
                                                 "glu_linear_offset": 1.0, "cache_quantized_input": False}
    assert isinstance(eager.ClampedSwiGLU(alpha=2).args["alpha"], float)
    assert eager.Linear(4, 8).args == {
        "in_features": 4, "out_features": 8, "bias": True, "device": None, "dtype": None, "tensor_parallel_mode": None,
        "tensor_parallel_group": None, "sequence_parallel": False, "rng_state_tracker_function": None,
        "userbuffers_options": None, "accumulate_into_main_grad": False, "parallel_mode": None, "tp_size": 1}
