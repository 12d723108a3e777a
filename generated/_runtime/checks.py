"""A generated module's run-time checks of its inputs and parameters, with errors that say what
to do (part of a fusegen output's runtime: templates/runtime/, copied verbatim; do not edit).
"""

import torch

from .te_forms import check_format


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



def check_packed_form(module, x):
    """The packed-sequence call form of a module none of whose ops reads sequences: seq_lens is
    taken and ignored, but ``m(x, seq_lens)`` takes x [total, hidden], never [batch, seq,
    hidden]."""
    if getattr(x, "dim", None) is not None and x.dim() == 3:
        raise ValueError(f"{module}: seq_lens was given with a 3-D x {list(x.shape)}; packed "
                         "sequences take x [total_tokens, hidden] with seq_lens [batch]: pass "
                         "x.flatten(0, 1), or leave seq_lens out (a 3-D x is batch sequences of "
                         "x.shape[1] tokens)")


def packed_sequences(module, x, seq_lens, max_seqlen, few_rows=None, qkv_format=None, offsets=None,
                     positions=None, ranks=1):
    """(cu_seqlens, max_seqlen) of a call: int32 offsets [batch + 1] on x's device and the host
    int bounding the longest sequence. Call forms: ``m(x, seq_lens)`` with x [total, hidden] and
    seq_lens [batch] (int32 or int64, on x's device or the CPU); ``m(x)`` with a 2-D x (one
    sequence) or a 3-D x [batch, seq, hidden] (batch-major: batch sequences of seq tokens).
    ``max_seqlen``: at least the longest length. The bound passed on is:
    - x on a device (not the CPU) of at most ``few_rows`` rows (a module that replays CUDA
      graphs there: its ``cuda_graphs.max_rows``): the rows (x's sequence length without
      seq_lens), whatever ``max_seqlen`` says, so one graph per row and batch count serves every
      set of lengths (max_seqlen is a bound: the ops that read it, FlashAttention-2, compute the
      same for any bound of the longest length);
    - under torch.compile without ``max_seqlen``: the rows (no sync, no data-dependent guard);
    - otherwise ``max_seqlen``, or without it the longest length, which a CPU seq_lens gives
      without a device sync and a device one with one (.tolist()).
    No sync means the lengths are checked on the device (torch._assert_async), before anything
    reads the offsets. The rows as a bound costs FlashAttention-2 empty blocks (it launches
    blocks for max_seqlen tokens a sequence): nothing at a few rows, more at many (pass
    max_seqlen then). One quick pass a call; errors say what to pass.
    ``offsets``: TE's cu_seqlens_q (te_sequences) in place of seq_lens, taken as they are (their
    start checked to be 0 with the lengths). ``positions``: the most tokens a sequence may have
    (the rows of TE's rotary table, forward(rotary_pos_emb=...)), checked with the lengths.
    ``ranks``: x is this rank's share of the tokens of a tensor-parallel group of ``ranks``
    (sequence parallelism), which the ops all-gather in rank order before they read the
    sequences: the call form describes all of them (seq_lens summing to ranks * x.shape[0]; a 3-D
    x one of ranks * batch sequences, the ranks' batches in rank order; with qkv_format "sbhd" the
    ranks' shares of each sequence, along its seq dim)."""
    if max_seqlen is not None and (type(max_seqlen) is not int or max_seqlen < 0):  # (not a bool)
        raise TypeError(f"{module}: max_seqlen must be None or an int of 0 or more (the longest "
                        f"sequence's length, or more), got {max_seqlen!r}")
    dims = x.dim()
    if qkv_format is not None:  # a TE module's qkv_format: the one form TE takes
        check_format(module, x, seq_lens, qkv_format)
        # [seq, batch, hidden]: batch sequences of seq tokens, as [batch, seq]
        if qkv_format == "sbhd":
            x = x.transpose(0, 1)
    compiling = torch.compiler.is_compiling()
    if seq_lens is None and offsets is None:
        if dims not in (2, 3):
            raise ValueError(f"{module}: x must be 2-D [tokens, hidden] (one sequence) or 3-D "
                             f"[batch, seq, hidden] (batch sequences of seq tokens), got "
                             f"{list(x.shape)}")
        batch, seq = (1, x.shape[0]) if dims == 2 else (x.shape[0], x.shape[1])
        # the ranks' shares joined along x's dim 0 (TE's): an sbhd x's seq (here dim 1), else its
        # rows or batch
        batch, seq = (batch, seq * ranks) if dims == 2 or qkv_format == "sbhd" else (
            batch * ranks, seq)
        _check_bound(module, max_seqlen, seq, "x's sequence length")
        _check_positions(module, positions, seq)
        cu_seqlens = torch.arange(batch + 1, dtype=torch.int32, device=x.device) * seq
        few = _few_rows(x, few_rows, compiling, batch * seq)
        return cu_seqlens, seq if max_seqlen is None or few else max_seqlen
    if dims == 3:
        check_packed_form(module, x)
    if dims != 2:
        raise ValueError(f"{module}: with seq_lens, x must be 2-D [total_tokens, hidden], got "
                         f"{list(x.shape)}")
    rows = x.shape[0] * ranks
    # (sequence parallel: the rows of x on all the ranks)
    held = "x's" if ranks == 1 else f"the {ranks} ranks' x's"
    few = _few_rows(x, few_rows, compiling, rows)
    if offsets is None:
        _check_lengths(module, x, seq_lens)
        cu_seqlens = torch.nn.functional.pad(torch.cumsum(seq_lens, 0, dtype=torch.int64), (1, 0))
    else:  # TE's offsets as they are (te_sequences checked their form): no lengths summed back
        if offsets.device.type != "cpu" and offsets.device != x.device:
            raise ValueError(f"{module}: cu_seqlens_q is on {offsets.device} but x on {x.device}; put it "
                             "on x's device (or on the CPU)")
        seq_lens, cu_seqlens = offsets.diff(), offsets
    lowest, longest = torch.aminmax(seq_lens)  # one reduction for both
    # the lengths read on the host where that costs no device sync (a CPU seq_lens outside
    # compile), or where no bound is known (a device seq_lens, no max_seqlen, many rows: a sync)
    if ((seq_lens.device.type == "cpu" and not compiling)
            or (max_seqlen is None and not few and not compiling)):
        start, lowest, total, longest = torch.stack(
            [cu_seqlens[0].long(), lowest.long(), cu_seqlens[-1].long(), longest.long()]).tolist()
        given = "seq_lens" if offsets is None else "cu_seqlens_q"
        if start != 0:
            raise ValueError(
                f"{module}: cu_seqlens_q must start at 0 (offsets of x's rows), got {start}")
        if lowest < 0:
            raise ValueError(f"{module}: {given} holds a negative length ({lowest}); lengths are "
                             "0 or more" + ("" if offsets is None else ": the offsets must not decrease"))
        if total != rows:
            raise ValueError(f"{module}: " + (f"seq_lens sums to {total} tokens" if offsets is None else
                                              f"cu_seqlens_q ends at {total}") + f" but {held} rows are {rows}; "
                             "the lengths of the packed sequences must add up to them")
        _check_bound(module, max_seqlen, longest, f"the longest of {given}")
        _check_positions(module, positions, longest)
        bound = longest if max_seqlen is None else max_seqlen
    else:  # no sync: the device checks them before anything reads the offsets
        bound = rows if max_seqlen is None else max_seqlen
        valid = (lowest >= 0) & (cu_seqlens[-1] == rows) & (longest <= bound)
        if offsets is not None:
            valid &= cu_seqlens[0] == 0
        if positions is not None and positions < bound:  # (else longest <= bound says it)
            valid &= longest <= positions
        what = ("seq_lens must be lengths of 0 or more" if offsets is None else
                "cu_seqlens_q must be non-decreasing offsets from 0 of lengths")
        torch._assert_async(
            valid, f"{module}: {what} summing to {held} {rows} rows"
            + (f", the longest at most max_seqlen={bound}" if max_seqlen is not None else "")
            + (f", at most forward(rotary_pos_emb=...)'s {positions} positions"
               if positions is not None and positions < bound else ""))
    return (cu_seqlens.to(device=x.device, dtype=torch.int32, non_blocking=True),
            rows if few else bound)


def _few_rows(x, few_rows, compiling, rows):
    """Whether a call's bound is its rows (packed_sequences). Never asked under compile: rows may
    be symbolic there, and a guard on them would recompile."""
    return few_rows is not None and not compiling and x.device.type != "cpu" and rows <= few_rows


def _check_lengths(module, x, seq_lens):
    """seq_lens' type, dtype, shape and device (its values: packed_sequences)."""
    if not isinstance(seq_lens, torch.Tensor):
        raise TypeError(f"{module}: seq_lens must be a torch.Tensor of int32 or int64 lengths "
                        f"[batch], got {type(seq_lens).__name__}; e.g. "
                        "torch.tensor(lengths, dtype=torch.int32)")
    if seq_lens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{module}: seq_lens must have dtype int32 or int64 (the sequences' "
                        f"lengths), got {seq_lens.dtype}; convert it, e.g. seq_lens.int()")
    if seq_lens.dim() != 1 or seq_lens.numel() == 0:
        raise ValueError(f"{module}: seq_lens must be 1-D [batch] with one length a sequence, at "
                         f"least one, got shape {list(seq_lens.shape)}")
    if seq_lens.device.type != "cpu" and seq_lens.device != x.device:
        raise ValueError(f"{module}: seq_lens is on {seq_lens.device} but x on {x.device}; put it "
                         "on x's device or on the CPU (a CPU seq_lens gives the longest length "
                         "without a device sync)")


def _check_positions(module, positions, longest):
    """The longest sequence against TE's rotary table's rows (packed_sequences' ``positions``)."""
    if positions is not None and positions < longest:
        raise ValueError(f"{module}: forward(rotary_pos_emb=...) has {positions} positions but the "
                         f"longest sequence has {longest} tokens; build it for at least {longest} "
                         "(RotaryPositionEmbedding(d)(max_seq_len))")


def _check_bound(module, max_seqlen, longest, what):
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"{module}: max_seqlen={max_seqlen} is less than {what}, {longest}; give "
                         "the longest length or more, or leave max_seqlen out")
