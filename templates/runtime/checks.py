"""A generated module's run-time checks of its inputs and parameters, with errors that say what
to do (part of a fusegen output's runtime: templates/runtime/, copied verbatim; do not edit).
"""

import torch


def check_input(module, name, tensor, features, like, lead=None, multiple_of=1,
                like_is="the module's parameters are", any_shape=False, shape=None):
    """Clear run-time errors for a wrong type, feature size, dtype, device or row shape.
    ``features``: the size the last dimension must have, or None for any size that is a multiple
    of ``multiple_of`` (a size-generic pipeline). ``any_shape``: any shape, 0-D included (an
    elementwise pipeline: TE's elementwise ops take any shape); ``shape``: exactly this shape
    (x's, for an extra input of such a pipeline). ``like``: the tensor whose dtype and device the
    input must have (a parameter, or x in a pipeline without parameters), ``like_is`` what it is.
    Every call: one quick pass, the messages only when it finds something."""
    if not _input_fits(tensor, features, like, lead, multiple_of, any_shape, shape):
        _input_error(module, name, tensor, features, like, lead, multiple_of, like_is, any_shape,
                     shape)


def _input_fits(tensor, features, like, lead, multiple_of, any_shape, shape):
    """check_input's quick pass (a generated module's every call: about a third quicker than the
    messages' checks in their order, measured on an H100 machine's host)."""
    try:
        dtype, size = tensor.dtype, tensor.shape
    except AttributeError:  # not a tensor: the messages say what it is
        return False
    if dtype is not like.dtype or not dtype.is_floating_point or tensor.device != like.device:
        return False
    if shape is not None:
        return size == shape
    if features is None:
        fits = any_shape or (len(size) >= 1 and size[-1] % multiple_of == 0)
    else:
        fits = len(size) >= 1 and size[-1] == features
    return fits and (lead is None or size[:-1] == lead)


def _input_error(module, name, tensor, features, like, lead, multiple_of, like_is, any_shape,
                 shape):
    """Raises the error that names what check_input's quick pass refused."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{module}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():  # as torch's own ops refuse them (in float they'd be wrong)
        raise TypeError(f"{module}: {name} has dtype {tensor.dtype}, but the module takes floating-"
                        "point tensors only (float32, float16, bfloat16; float64 on CPU); convert "
                        "it, e.g. x.float()")
    if shape is not None:
        if tensor.shape != shape:
            raise ValueError(f"{module}: {name} must have x's shape, {list(shape)}, got "
                             f"{list(tensor.shape)}")
    elif features is None:
        if not any_shape and (tensor.dim() < 1 or tensor.shape[-1] % multiple_of):
            constraint = " (rows of n values)" if multiple_of == 1 else (
                f" with n a multiple of {multiple_of} (the pipeline's GLUs split each row)")
            raise ValueError(f"{module}: {name} must have shape [..., n]{constraint}, got "
                             f"{list(tensor.shape)}")
    elif tensor.dim() < 1 or tensor.shape[-1] != features:
        raise ValueError(f"{module}: {name} must have shape [..., {features}], got "
                         f"{list(tensor.shape)}")
    if tensor.dtype != like.dtype:
        raise TypeError(f"{module}: {name} has dtype {tensor.dtype} but {like_is} {like.dtype}; "
                        "convert the input or the module (module.to(dtype))")
    if tensor.device != like.device:
        meta = "" if like.device.type != "meta" else (
            " (meta parameters hold no values: module.to_empty(device=...), then "
            "module.reset_parameters() or load_state_dict)")
        raise ValueError(f"{module}: {name} is on {tensor.device} but {like_is} on "
                         f"{like.device}; move one of them{meta}")
    if lead is not None and tensor.shape[:-1] != lead:
        raise ValueError(f"{module}: {name} must have the same leading shape as x, {list(lead)}, "
                         f"got {list(tensor.shape[:-1])}")
    raise AssertionError(f"{module}: check_input's quick pass refused {name}, but no check names "
                         "why")


def check_parameters(module, keys, shapes, parameters):
    """Clear run-time errors for a parameter replaced or cast since the module was built (a
    tensor of another shape, dtype or device than the others; the kernels would read it as the
    first one's): ``keys`` their state_dict keys, ``shapes`` the shapes the spec gives them. Every
    call: one quick pass, the messages only when it finds something."""
    if not _parameters_agree(shapes, parameters):
        _parameter_error(module, keys, shapes, parameters)


def _parameters_agree(shapes, parameters):
    """Whether the parameters have their shapes, one dtype and one device (the quick pass: about
    0.75 us a parameter on an H100 machine's host, a third less than with an isinstance check and
    get_device and is_meta per parameter)."""
    try:
        first = parameters[0]
        dtype, device = first.dtype, first.device
        for shape, parameter in zip(shapes, parameters):
            if (parameter.dtype is not dtype or parameter.shape != shape
                    or parameter.device != device):
                return False
    except AttributeError:  # not a tensor (None, say): the messages say which
        return False
    return True


def _parameter_error(module, keys, shapes, parameters):
    """Raises the error that names the first parameter check_parameters' quick pass refused."""
    first = parameters[0]
    for key, shape, parameter in zip(keys, shapes, parameters):
        if not isinstance(parameter, torch.Tensor):
            raise TypeError(f"{module}: parameter {key} must be a torch.Tensor, got "
                            f"{type(parameter).__name__}")
        if parameter.shape != shape:
            raise ValueError(f"{module}: parameter {key} has shape {list(parameter.shape)}, but "
                             f"the spec's op makes it {list(shape)}; load a state_dict of the "
                             "spec's shapes, or regenerate the module from a spec of the new "
                             "sizes")
        if parameter.dtype != first.dtype:
            raise TypeError(f"{module}: parameter {key} has dtype {parameter.dtype} but {keys[0]} "
                            f"has {first.dtype}; the module computes in one dtype: cast the whole "
                            "module (module.to(dtype))")
        if parameter.device != first.device:
            raise ValueError(f"{module}: parameter {key} is on {parameter.device} but {keys[0]} is "
                             f"on {first.device}; move the whole module (module.to(device))")
    raise AssertionError(f"{module}: check_parameters' quick pass refused a parameter, but no "
                         "check names which")


def check_row_input(module, name, tensor, like, lead, like_is="the module's parameters are"):
    """Clear run-time errors for a per-row input (a row-scaled activation's scales): one value per
    row, shape ``lead`` (the output's shape without its last dim)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{module}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.shape != lead:
        raise ValueError(f"{module}: {name} holds one scale per row: it must have shape "
                         f"{list(lead)}, got {list(tensor.shape)}")
    check_input(module, name, tensor.unsqueeze(-1), 1, like, None, like_is=like_is)
