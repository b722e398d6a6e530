"""The course's one comparator, its tolerance table, and NaN canaries.

Every check in the course goes through :func:`assert_close`. It has two modes:

* **elementwise** (default): ``|actual - expected| <= atol + rtol * |expected|`` everywhere, with
  ``(rtol, atol)`` looked up by dtype in :data:`TOLERANCES`;
* **baseline** (``baseline=``): the kernel's worst error against the fp32 reference may be at most
  ``factor`` times PyTorch's own worst error in the same low dtype, plus a rounding floor. This is
  the rule the FlashAttention tests use for attention and reductions, where a fixed atol is either
  too loose for small problems or too strict for large ones.

Either way a failure says how many elements differ, where the worst one is, the first few
mismatches, and where NaN or inf appear in one tensor but not the other.

The interpreter does not catch out-of-bounds loads (they read whatever host memory is there), so
:func:`nan_canary` places an input inside a larger NaN-filled buffer: a load that strays past the
edge reads NaN, and the NaN shows up in the output. A stray lane whose value never reaches the output
(an unmasked load zeroed afterwards, or never stored) shows nothing there; :func:`bounds_checked`
catches it by checking every live lane's address against the launch's tensors while a kernel runs.

The labs' check, :func:`check_cases`, uses all of it, and refuses the course's references (and library
functions that are a task's answer) while the learner's function runs (:func:`refusing`).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import linecache
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float


# One table for the whole course, keyed by the dtype of the tensor under test.
# rtol is about two units of roundoff of that dtype (fp16: 2**-11 = 4.9e-4; bf16: 2**-8 = 3.9e-3;
# e4m3: 2**-4; e5m2: 2**-3); atol covers values that round to or near zero.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(rtol=1e-7, atol=1e-9),
    torch.float32: Tolerance(rtol=1e-5, atol=1e-6),
    torch.float16: Tolerance(rtol=1e-3, atol=1e-5),
    torch.bfloat16: Tolerance(rtol=1.6e-2, atol=1e-5),
    torch.float8_e4m3fn: Tolerance(rtol=1.25e-1, atol=1e-3),
    torch.float8_e5m2: Tolerance(rtol=2.5e-1, atol=1e-3),
}

_FIRST_MISMATCHES = 5


class MismatchError(AssertionError):
    """Raised by :func:`assert_close`; the message is the full report."""


def tolerance(dtype: torch.dtype) -> Tolerance:
    """The table's entry for ``dtype``; integer and bool dtypes compare exactly."""
    if dtype in TOLERANCES:
        return TOLERANCES[dtype]
    if not dtype.is_floating_point:
        return Tolerance(rtol=0.0, atol=0.0)
    raise KeyError(f"no tolerance for {dtype}; add it to kernels.testing.TOLERANCES")


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    baseline: torch.Tensor | None = None,
    factor: float = 2.0,
    name: str = "result",
) -> None:
    """Check ``actual`` against the reference ``expected``; raise :class:`MismatchError` with a report.

    ``dtype`` selects the tolerance (default: ``actual.dtype``). NaN and inf must appear at the same
    places, with the same sign for inf. With ``baseline`` (PyTorch's own result in the low dtype),
    the check is ``max|actual - expected| <= factor * max|baseline - expected| + floor`` where the
    floor is one unit of roundoff of ``dtype`` at the largest ``|expected|`` plus its atol.
    """
    if not isinstance(actual, torch.Tensor) or not isinstance(expected, torch.Tensor):
        raise TypeError(f"{name}: expected two tensors, got {type(actual).__name__} and {type(expected).__name__}")
    if actual.shape != expected.shape:
        raise MismatchError(f"{name}: shape {tuple(actual.shape)} differs from the reference's {tuple(expected.shape)}")
    dtype = dtype or actual.dtype
    tol = tolerance(dtype)
    wide = torch.float64
    a = actual.detach().to("cpu", wide)
    e = expected.detach().to("cpu", wide)

    special, special_mask = _special_values(a, e)
    finite = torch.isfinite(a) & torch.isfinite(e)
    diff = torch.where(finite, (a - e).abs(), torch.zeros_like(a))

    if baseline is not None:
        if baseline.shape != expected.shape:
            raise ValueError(f"{name}: baseline shape {tuple(baseline.shape)} differs from {tuple(expected.shape)}")
        b = baseline.detach().to("cpu", wide)
        b_finite = torch.isfinite(b) & torch.isfinite(e)
        err_base = float(torch.where(b_finite, (b - e).abs(), torch.zeros_like(b)).max()) if b.numel() else 0.0
        scale = float(e[torch.isfinite(e)].abs().max()) if torch.isfinite(e).any() else 0.0
        floor = _unit_roundoff(dtype) * scale + tol.atol
        allowed = torch.full_like(e, factor * err_base + floor)
        rule = f"baseline rule: error <= {factor:g} x PyTorch's own error {err_base:.3g} + floor {floor:.3g}"
    else:
        allowed = tol.atol + tol.rtol * e.abs()
        rule = f"rtol={tol.rtol:g}, atol={tol.atol:g}"

    bad = finite & (diff > allowed)
    n_bad = int((bad | special_mask).sum())
    if n_bad == 0:
        return
    lines = [f"{name}: {n_bad} of {e.numel()} elements differ ({str(dtype).removeprefix('torch.')}, {rule})"]
    if bad.any():
        excess = torch.where(bad, diff - allowed, torch.full_like(diff, -1.0))
        worst = _unravel(int(excess.argmax()), e.shape)
        lines.append(
            f"  worst finite mismatch at index {worst}: got {a[worst].item():.6g}, expected {e[worst].item():.6g}, "
            f"|diff| {diff[worst].item():.3g} (allowed {allowed[worst].item():.3g})"
        )
        first = bad.flatten().nonzero().flatten()[:_FIRST_MISMATCHES].tolist()
        shown = ", ".join(
            f"{_unravel(i, e.shape)}: {a.flatten()[i].item():.6g} vs {e.flatten()[i].item():.6g}" for i in first
        )
        lines.append(f"  first mismatches (got vs expected): {shown}")
    lines.extend(special)
    raise MismatchError("\n".join(lines))


def _special_values(a: torch.Tensor, e: torch.Tensor) -> tuple[list[str], torch.Tensor]:
    """Report lines and a mask for NaN/inf that appear in one tensor and not at the same place in the other."""
    lines = []
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    extra_nan = nan_a & ~nan_e
    missed_nan = nan_e & ~nan_a
    if extra_nan.any() or missed_nan.any():
        where = _unravel(int((extra_nan | missed_nan).flatten().nonzero()[0]), e.shape)
        lines.append(
            f"  NaN: {int(extra_nan.sum())} where the reference is not NaN, {int(missed_nan.sum())} NaN of the "
            f"reference missing (first at {where})"
        )
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    inf_disagree = (inf_a | inf_e) & ~(nan_a | nan_e) & ~(inf_a & inf_e & (torch.sign(a) == torch.sign(e)))
    if inf_disagree.any():
        where = _unravel(int(inf_disagree.flatten().nonzero()[0]), e.shape)
        lines.append(
            f"  inf: {int(inf_disagree.sum())} places where inf differs (first at {where}: got "
            f"{a[where].item()}, expected {e[where].item()})"
        )
    return lines, extra_nan | missed_nan | inf_disagree


def _unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0


def _unravel(flat: int, shape: torch.Size) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |actual - expected|`` in float64 over the places where both are finite."""
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    finite = torch.isfinite(a) & torch.isfinite(e)
    return float((a - e).abs()[finite].max()) if finite.any() else 0.0


def stable_digits(x: float, digits: int, margin: float = 1e-4) -> str:
    """``x`` formatted to ``digits`` decimals, after asserting that it lies at least ``margin`` from a
    rounding boundary (..5 in the next digit). A value computed in floating point differs in its last
    bits between CPUs (instruction set, BLAS, threads); printed this way, the stored digits are the
    same on every machine whose error stays below ``margin``, and a value too close to call fails
    loudly instead of printing a digit that another CPU would round the other way."""
    if digits < 0 or margin < 0:
        raise ValueError(f"digits and margin must be >= 0, got {digits} and {margin}")
    scaled = abs(x) * 10**digits
    distance = abs(scaled % 1 - 0.5) / 10**digits            # to the nearest rounding boundary
    if not distance >= margin:                                 # NaN fails too
        raise AssertionError(f"{x!r} is within {margin} of a rounding boundary at {digits} decimals: "
                             "print a bound or fewer digits")
    return f"{x:.{digits}f}"


def nan_canary(x: torch.Tensor, pad: int = 64, *, rows: bool = False) -> torch.Tensor:
    """Return a view of a copy of ``x`` that sits inside a larger buffer filled with NaN.

    ``rows=False``: a contiguous view with ``pad`` NaN elements before and after it, which catches
    loads past the start or end of the whole tensor (an unmasked tail block).
    ``rows=True``: every row (last dimension) gets ``pad`` NaN elements on each side, so the view
    has a row stride larger than its row length; this catches a kernel that reads past the end of
    a row. Only kernels that honour the row stride can take such an input.
    Integer tensors are padded with the dtype's minimum instead of NaN.
    """
    if pad < 1:
        raise ValueError(f"pad must be at least 1, got {pad}")
    fill = float("nan") if x.dtype.is_floating_point else torch.iinfo(x.dtype).min
    if rows:
        if x.dim() == 0:
            raise ValueError("rows=True needs a tensor with at least one dimension")
        n = x.shape[-1]
        buf = torch.full((*x.shape[:-1], n + 2 * pad), fill, dtype=x.dtype, device=x.device)
        view = buf[..., pad : pad + n]
    else:
        buf = torch.full((x.numel() + 2 * pad,), fill, dtype=x.dtype, device=x.device)
        view = buf[pad : pad + x.numel()].view(x.shape)
    view.copy_(x)
    return view.requires_grad_(x.requires_grad)


class BorrowedReference(MismatchError):
    """Raised when a learner's function, run by a lab's check, calls the course's reference for its task."""


class _Refused:
    """A stand-in for a course reference, or for a library function that computes a task's answer in one
    call: calling it, or launching it as a Triton kernel (``kernel[grid](...)``), raises
    :class:`BorrowedReference`."""

    def __init__(self, reference, library_name: str | None = None):
        if library_name is not None:
            self.message = (f"your function calls {library_name}, which computes this task's answer in one call; "
                            "write it yourself")
        else:
            target = getattr(reference, "fn", reference)    # a Triton JITFunction wraps its Python function
            where = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"
            self.message = f"your function calls the course's reference {where}; write it yourself"

    def __call__(self, *args, **kwargs):
        raise BorrowedReference(self.message)

    def __getitem__(self, grid):
        return self


def _library_function(name: str):
    """``(owner, attribute, function)`` for a dotted name such as ``"torch.nn.functional.softmax"`` or
    ``"torch.Tensor.softmax"``: the longest importable module prefix, then attributes down to the function."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:-1]:
            owner = getattr(owner, part)
        return owner, parts[-1], getattr(owner, parts[-1])
    raise ValueError(f"refuse: {name!r} names no importable function")


@contextlib.contextmanager
def refusing(references, namespace: dict | None = None):
    """While the block runs, every name bound to one of ``references`` raises :class:`BorrowedReference`
    when called: the names in every loaded ``kernels`` module (``kernels.x.f``, ``import kernels.x as m``,
    a package's re-export) and in ``namespace`` (the learner's globals: ``from kernels.x import f``).
    A reference given as a dotted string names a library function that is the task's answer
    (``"torch.softmax"``, ``"torch.nn.functional.softmax"``, the method ``"torch.Tensor.softmax"``): it is
    replaced where it lives too, so ``F.softmax(x)`` and ``x.softmax(-1)`` are refused as well.
    The original bindings are restored on exit, so the check's own call of the reference is unaffected."""
    library = [(name, *_library_function(name)) for name in references if isinstance(name, str)]
    stand_ins = {id(r): _Refused(r) for r in references if not isinstance(r, str)}
    stand_ins.update({id(fn): _Refused(fn, name) for name, _, _, fn in library})
    scopes = [m.__dict__ for n, m in list(sys.modules.items()) if n == "kernels" or n.startswith("kernels.")]
    if namespace is not None:
        scopes.append(namespace)
    bound = [(scope, key, value) for scope in scopes for key, value in list(scope.items()) if id(value) in stand_ins]
    homes = [(owner, attr, fn, attr in vars(owner)) for _, owner, attr, fn in library]   # a method may be inherited
    try:
        for scope, key, value in bound:
            scope[key] = stand_ins[id(value)]
        for owner, attr, fn, _ in homes:
            setattr(owner, attr, stand_ins[id(fn)])
        yield
    finally:
        for owner, attr, fn, own_attr in reversed(homes):
            if own_attr:
                setattr(owner, attr, fn)
            else:
                delattr(owner, attr)                          # back to the base class's method
        for scope, key, value in bound:
            scope[key] = value


def own(fn, *references):
    """``fn`` run with the course's ``references`` refused (:func:`refusing`, in ``fn``'s globals too):
    a lab's check wraps the learner's function in it, so an answer that calls the reference fails
    with "your function calls the course's reference ...; write it yourself"."""
    if not references:
        raise ValueError("own: name at least one reference to refuse")
    refs = {id(inner): ref for ref in references
            for inner in _layers(_library_function(ref)[2] if isinstance(ref, str) else ref)}
    same = next((refs[id(layer)] for layer in _layers(fn) if id(layer) in refs), None)
    if same is not None:            # the learner's name bound to the reference itself: `from kernels.x import f`
        refusal = _Refused(same, same if isinstance(same, str) else None)

        @functools.wraps(fn)
        def bound(*args, **kwargs):
            raise BorrowedReference(refusal.message.replace("your function calls", "your function is", 1))

        return bound

    scope = next((layer.__globals__ for layer in reversed(_layers(fn)) if hasattr(layer, "__globals__")), None)

    @functools.wraps(fn)
    def owned(*args, **kwargs):
        with refusing(references, scope):
            return fn(*args, **kwargs)

    return owned


class _Launches:
    """Stands in for a Triton kernel in a learner's globals and counts its launches (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def launching(fn, kernel: str):
    """``fn``, a launcher the learner wrote, required to launch the Triton kernel bound to the name ``kernel`` in
    its globals: a launcher that computes the result in PyTorch instead fails with "... never launched ...".
    The learner's names (and the references :func:`own` refuses there) are those of ``fn``'s globals."""
    scope = fn.__globals__

    @functools.wraps(fn)
    def run(*args, **kwargs):
        real = scope[kernel]
        scope[kernel] = counter = _Launches(real)
        try:
            out = fn(*args, **kwargs)
        finally:
            scope[kernel] = real
        if not counter.count:
            raise MismatchError(f"{fn.__name__} never launched {kernel}: the result must come from your Triton kernel, "
                                "not from PyTorch in the launcher")
        return out

    return run


def _layers(fn) -> list:
    """``fn`` and what it wraps: a ``functools.partial``'s function, a decorator's ``__wrapped__``, a Triton
    JITFunction's Python function."""
    out = []
    while fn is not None and all(fn is not seen for seen in out):
        out.append(fn)
        fn = getattr(fn, "func", None) or getattr(fn, "__wrapped__", None) or getattr(fn, "fn", None)
    return out


# ---------------------------------------------------------------------------------------------
# Bounds-checked launches under Triton's interpreter


class OutOfBounds(MismatchError):
    """Raised by :func:`check_cases` when a lane that a kernel's mask leaves on addressed memory outside
    every tensor of its launch, even though the result came out right (:func:`bounds_checked`)."""


@dataclass(frozen=True)
class _Region:
    """The memory of one tensor argument of a launch, in bytes."""

    name: str                       # the kernel parameter it was passed as
    tensor: torch.Tensor
    start: int                      # address of element 0
    stop: int                       # one past the last byte of the last element
    elements: np.ndarray | None     # sorted addresses of its elements, for a view with gaps (row strides)

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> "_Region":
        es, base = t.element_size(), t.data_ptr()
        if t.is_contiguous():
            return cls(name, t, base, base + es * t.numel(), None)
        offsets = torch.zeros((), dtype=torch.int64)
        for size, stride in zip(t.shape, t.stride()):            # offsets[i, j, ...] = sum(index * stride)
            offsets = offsets[..., None] + stride * torch.arange(size)
        elements = np.unique(base + es * offsets.flatten().numpy())
        return cls(name, t, base, int(elements[-1]) + es, elements)

    def holds(self, addr: np.ndarray, width: int) -> np.ndarray:
        """Whether each access of ``width`` bytes at ``addr`` lies inside one element."""
        inside = (addr >= self.start) & (addr + width <= self.stop)
        if self.elements is not None:
            i = np.clip(np.searchsorted(self.elements, addr, side="right") - 1, 0, None)
            inside &= addr + width <= self.elements[i] + self.tensor.element_size()
        return inside

    def where(self, addr: int) -> str:
        """Where ``addr`` lies relative to this tensor, in its elements."""
        es, t, n = self.tensor.element_size(), self.tensor, self.name
        size = f"{t.numel()} elements" + (f", shape {tuple(t.shape)}" if t.dim() > 1 else "")
        if addr < self.start:
            return f"{-((addr - self.start) // es)} element(s) before the start of {n} ({size})"
        rel = (addr - self.start) // es
        if addr >= self.stop:
            return f"element {rel} of {n}, past its end ({n} holds {size})"
        if t.dim() >= 2 and t.stride(-1) == 1 and rel % t.stride(-2) >= t.shape[-1]:
            return (f"column {rel % t.stride(-2)} of a row of {n}, past the row's end ({t.shape[-1]} columns; "
                    f"the row stride {t.stride(-2)} skips memory that {n} does not hold)")
        return f"memory between the elements of {n} ({size}, strides {tuple(t.stride())})"


class _StrayLanes:
    """What :func:`bounds_checked` records: the launch's tensors, and the first stray access."""

    def __init__(self):
        self.regions: list[_Region] = []
        self.report: str | None = None       # the first stray access, described; None while there is none

    def launch(self, named_args) -> None:
        """Record the tensor arguments of a new launch (a tuple argument's tensors as ``name[i]``)."""
        self.regions = []
        pending = list(named_args)
        while pending:
            name, arg = pending.pop(0)
            if isinstance(arg, tuple):
                pending += [(f"{name}[{i}]", a) for i, a in enumerate(arg)]
                continue
            arg = getattr(arg, "base", arg)       # a TensorWrapper (reinterpreted dtype) or a TensorDescriptor
            if isinstance(arg, torch.Tensor) and arg.numel():
                self.regions.append(_Region.of(name, arg))

    def lanes(self, op: str, builder, ptrs, mask) -> tuple[np.ndarray, np.ndarray]:
        """``(live, stray)`` for one access: the lanes its mask leaves on, and those of them that address
        no element of the launch's tensors (the first access with a stray lane goes into :attr:`report`)."""
        addr = ptrs.data.astype(np.int64)
        width = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        live = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
        inside = np.zeros(addr.shape, dtype=bool)
        for region in self.regions:
            inside |= region.holds(addr, width)
        stray = live & ~inside
        if stray.any() and self.report is None:
            self.report = self._describe(op, builder, addr, stray)
        return live, stray

    def _describe(self, op: str, builder, addr: np.ndarray, stray: np.ndarray) -> str:
        first = tuple(int(i) for i in np.argwhere(stray)[0])
        lane = first[0] if len(first) == 1 else first
        a = int(addr[first])
        grid = [d for d in builder.grid_dim]
        rank = max([i + 1 for i, d in enumerate(grid) if d > 1] or [1])
        pid = builder.grid_idx[0] if rank == 1 else tuple(builder.grid_idx[:rank])
        if self.regions:              # described from the tensor it lies in or nearest to
            near = min(self.regions, key=lambda r: r.start - a if a < r.start else max(0, a - r.stop + 1))
            place = near.where(a)
        else:
            place = "memory, and the launch passed no tensor"
        if op == "tl.load":
            verb, fix = "reads", ("on a GPU they read out of bounds even when their values are never used: add mask=... to "
                                  "the tl.load (with an other= that is neutral for what follows) so those lanes do not load")
        else:
            verb, fix = "writes", ("on a GPU they write out of bounds, over whatever lies there (the check did not write "
                                   "them): add mask=... to the tl.store so those lanes do not store")
        return (f"lane {lane} of your {op}{_kernel_line()}, program {pid}, {verb} {place}; {int(stray.sum())} of its "
                f"{stray.size} lanes are outside every tensor of the launch, and {fix}")


def _kernel_line() -> str:
    """`` in f, line n (`source`)`` for the innermost frame outside Triton and this module: the kernel's
    (or a jit helper's) line that made the access."""
    import triton

    skip = (str(Path(triton.__file__).parent), __file__)
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
    if frame is None:
        return ""
    text = re.sub(r"\s+#.*$", "", linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip())  # no comment
    return f" in {frame.f_code.co_name}, line {frame.f_lineno}" + (f" (`{text}`)" if text else "")


def _poison(dtype: np.dtype):
    """What a stray lane of a load reads: NaN, as :func:`nan_canary` pads inputs (an integer's minimum)."""
    if np.issubdtype(dtype, np.floating):
        return np.nan
    return np.iinfo(dtype).min if np.issubdtype(dtype, np.integer) else False


@contextlib.contextmanager
def bounds_checked():
    """While the block runs, every Triton launch under the interpreter is bounds-checked: each lane of a
    ``tl.load`` or ``tl.store`` that its mask leaves on must address an element of one of the launch's
    tensor arguments. A stray lane is not accessed: a load reads NaN there (an integer load its dtype's
    minimum), the poison :func:`nan_canary` puts around inputs, and a store skips it; the first one is
    described (lane, kernel line, program, which tensor it strays from) in the yielded object's
    ``report``. On a GPU this catches nothing (the kernels are compiled, not interpreted); it is for the
    course's CPU checks, where an unmasked load whose lanes are never stored otherwise passes unseen.
    An access that strays into another tensor of the same launch (or onto another element of its own)
    is not seen, and atomics are not checked."""
    lanes = _StrayLanes()
    if "triton" not in sys.modules:          # no kernel has been defined, so none can launch: spare the import
        yield lanes
        return
    from triton.runtime import interpreter

    builder, executor = interpreter.InterpreterBuilder, interpreter.GridExecutor
    load, store, init_args = builder.create_masked_load, builder.create_masked_store, executor._init_args_hst

    def checked_load(self, ptrs, mask, other, *rest):
        live, stray = lanes.lanes("tl.load", self, ptrs, mask)
        if not stray.any():
            return load(self, ptrs, mask, other, *rest)
        out = load(self, ptrs, interpreter.TensorHandle(live & ~stray, mask.dtype), other, *rest)
        out.data[stray] = _poison(out.data.dtype)
        return out

    def checked_store(self, ptrs, value, mask, *rest):
        live, stray = lanes.lanes("tl.store", self, ptrs, mask)
        return store(self, ptrs, value, interpreter.TensorHandle(live & ~stray, mask.dtype), *rest)

    def recording_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        lanes.launch([*zip(self.arg_names, args_hst), *kwargs_hst.items()])
        return args_hst, kwargs_hst

    builder.create_masked_load, builder.create_masked_store = checked_load, checked_store
    executor._init_args_hst = recording_args
    try:
        yield lanes
    finally:
        builder.create_masked_load, builder.create_masked_store = load, store
        executor._init_args_hst = init_args


def _same(a, b) -> bool:
    return a.shape == b.shape and bool(((a == b) | (a != a) & (b != b)).all())   # NaN equals NaN here


def _dtype_slip(got, want) -> str | None:
    """"result is float64, the reference returns float32" when a tensor result's dtype differs."""
    pairs = list(zip(got, want)) if isinstance(got, tuple) and isinstance(want, tuple) else [(got, want)]
    for i, (g, w) in enumerate(pairs):
        if isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor) and g.dtype != w.dtype:
            which = f"result {i}" if len(pairs) > 1 else "result"
            name = lambda d: str(d).removeprefix("torch.")   # noqa: E731
            return f"{which} is {name(g.dtype)}, the reference returns {name(w.dtype)} (the task asks for {name(w.dtype)})"
    return None


def _borrowed(err: BaseException) -> str | None:
    """The refusal's message if ``err`` is, wraps or quotes a :class:`BorrowedReference` (the Triton
    interpreter re-raises errors from inside a kernel under its own type)."""
    seen = err
    while seen is not None:
        if isinstance(seen, BorrowedReference) or "; write it yourself" in str(seen):
            text = str(seen)
            return text[text.index("your function calls"):] if "your function calls" in text else text
        seen = seen.__cause__ or seen.__context__
    return None


def _notes(hints, got, want, args) -> list[str]:
    """The messages of the hints that apply (``got`` is None when the function raised); a hint that
    itself fails is skipped, so it never hides the report."""
    notes = []
    for hint in hints:
        try:
            note = hint(got, want, *args)
        except Exception:
            note = None
        if note:
            notes.append(note)
    return notes


def check_cases(fn, reference, cases, *, name: str | None = None, dtype: torch.dtype | None = None,
                refuse=(), hints=()) -> int:
    """Compare ``fn(*case)`` with ``reference(*case)`` for every case; the labs' check.

    Each case is a tuple of arguments (tensors are passed as they are, so a NaN canary keeps its
    padding). The reference runs first; an argument that ``fn`` then changed in place is reported as
    such, not as a wrong value. A result whose dtype differs from the reference's is reported before
    its values. ``fn``'s Triton launches are bounds-checked (:func:`bounds_checked`): a lane that strays
    outside the launch's tensors is added to a mismatch's report, and fails a right result with
    :class:`OutOfBounds`. ``refuse`` lists the course's references for the task, and dotted names of
    library functions that are its answer (``"torch.softmax"``): while ``fn`` runs they raise
    (:func:`own`). ``hints`` are functions ``hint(got, want, *case) -> str | None`` that name the slip,
    in the mechanism's terms, when a case differs (``got`` is None when the function raised); each
    message that applies is appended to the report. The first case that differs raises
    :class:`MismatchError` naming the case (its input shapes) and the first mismatching elements.
    Returns the number of cases checked, so a check cell can print it.
    """
    label = name or getattr(fn, "__name__", "function")
    run = own(fn, *refuse) if refuse else fn
    for i, case in enumerate(cases):
        args = case if isinstance(case, tuple) else (case,)
        shapes = ", ".join(str(tuple(a.shape)) if isinstance(a, torch.Tensor) else repr(a) for a in args)
        where = f"{label} on case {i} (inputs {shapes})"
        want = reference(*args)
        before = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
        with bounds_checked() as lanes:
            try:
                got = run(*args)
            except Exception as err:
                borrowed = _borrowed(err)
                if borrowed:
                    raise BorrowedReference(f"{where}: {borrowed}") from err
                raise MismatchError(f"{where}: your function raised {type(err).__name__}: {err}"
                                    + _stray(lanes) + _hint_lines(hints, None, want, args)) from err
        changed = [j for j, (a, b) in enumerate(zip(args, before)) if isinstance(a, torch.Tensor) and not _same(a, b)]
        if changed:
            raise MismatchError(f"{where}: your function modified its input argument {changed[0]} in place "
                                "(the task returns a new tensor and leaves its inputs alone)")
        try:
            slip = _dtype_slip(got, want)
            if slip:
                raise MismatchError(f"{where}: {slip}")
            assert_close(got, want, dtype=dtype, name=where)
        except Exception as err:
            report = str(err) if isinstance(err, MismatchError) else f"{where}: {err}"
            raise MismatchError(report + _stray(lanes) + _hint_lines(hints, got, want, args)) from err
        if lanes.report:                           # the hints name slips of the values, which are right here
            raise OutOfBounds(f"{where}: the result is right, but {lanes.report}")
    return len(cases)


def _stray(lanes: _StrayLanes) -> str:
    return f"\n  out of bounds: {lanes.report}" if lanes.report else ""


def _hint_lines(hints, got, want, args) -> str:
    return "".join(f"\n  hint: {h}" for h in _notes(hints, got, want, args))


def pinned_triton() -> bool:
    """Whether the installed Triton is requirements.txt's. A compile fact a test asserts as a number (a
    spill count, an instruction count) is that Triton's; under another version (``make compat``) a test
    checks only the version-independent part of the claim. True where requirements.txt is absent."""
    import triton

    req = Path(__file__).resolve().parent.parent / "requirements.txt"
    if not req.is_file():
        return True
    pin = re.search(r"^triton==(\S+)", req.read_text(), re.M)
    return pin is None or pin.group(1) == triton.__version__
