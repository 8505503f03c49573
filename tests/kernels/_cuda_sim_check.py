"""Run the numba CUDA kernels under NUMBA_ENABLE_CUDASIM=1 on numpy arrays and compare with the
torch reference. Executed in a subprocess by test_cuda_sim.py (the simulator must be chosen
before numba.cuda is imported, and it does not take torch tensors). Exit code 0: all agree;
77: the simulator cannot import (the test skips)."""

import os
import sys
import warnings

assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run me with NUMBA_ENABLE_CUDASIM=1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

try:
    from gradientflow.kernels import cuda as K
except Exception as exc:  # noqa: BLE001
    print(f"SKIP: the CUDA simulator cannot import: {exc!r}")
    sys.exit(77)

from gradientflow.kernels import reference as R  # noqa: E402

CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def wire_np(t):
    if t.dtype == torch.float32:
        return t.numpy()
    return t.view(torch.int16).numpy().view(np.uint16).copy()


def from_wire(a, dtype):
    if dtype == torch.float32:
        return torch.from_numpy(a)
    return torch.from_numpy(a.view(np.int16)).view(dtype)


def same_bits(a, b):
    a, b = a.contiguous(), b.contiguous()
    if a.dtype == torch.float32:
        ai, bi = a.view(torch.int32), b.view(torch.int32)
    else:
        ai, bi = a.view(torch.int16), b.view(torch.int16)
    ok = (ai == bi) | (torch.isnan(a.float()) & torch.isnan(b.float()))
    assert bool(ok.all()), (a, b)


def main():
    # inf - inf in the residual of overflowed values is intended; the simulator runs kernels in
    # other threads, where np.seterr (thread-local) would not reach.
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, 1e-8, 6e-8, 3e5],
                       dtype=np.float32)
    cases = 0
    for n, c in [(1, 4), (13, 3), (50, 16)]:
        nch = R.nchunks_of(n, c)
        for mode in (0, 1, 2):
            for has_r in (False, True):
                for l2 in ((mode + has_r) % 2 == 1,):  # both norms seen across the modes
                    g = rng.standard_normal(n).astype(np.float32)
                    g[: min(n, 3)] *= 1e3
                    r = rng.standard_normal(n).astype(np.float32) if has_r else None
                    mom = rng.standard_normal(n).astype(np.float32) if mode else None
                    mom_out = np.empty(n, np.float32) if mode else None
                    tg = torch.from_numpy(g.copy())
                    tmo = torch.empty(n) if mode else None
                    ref = R.chunk_norms(tg, None if r is None else torch.from_numpy(r), c,
                                        "l2" if l2 else "l1",
                                        momentum=None if mom is None else torch.from_numpy(mom),
                                        momentum_out=tmo, m=0.9, nesterov=mode == 2)
                    norms = np.empty(nch, np.float32)
                    K.launch_chunk_norms(g, r, mom, mom_out, mode, 0.9, c, l2, norms)
                    same_bits(torch.from_numpy(g), tg)
                    if mode:
                        same_bits(torch.from_numpy(mom_out), tmo)
                    torch.testing.assert_close(torch.from_numpy(norms), ref, rtol=1e-5, atol=1e-5)
                    # v into a buffer of its own, the gradient zeroed in the same pass
                    g2 = np.ascontiguousarray(rng.standard_normal(n).astype(np.float32))
                    tg2, tv2 = torch.from_numpy(g2.copy()), torch.empty(n)
                    ref2 = R.chunk_norms(tg2, None if r is None else torch.from_numpy(r), c,
                                         "l2" if l2 else "l1",
                                         momentum=None if mom is None else torch.from_numpy(mom),
                                         momentum_out=torch.empty(n) if mode else None, m=0.9,
                                         nesterov=mode == 2, v_out=tv2, zero_grad=True)
                    g3 = g2.copy()
                    vout = np.empty(n, np.float32)
                    norms2 = np.empty(nch, np.float32)
                    mom_out = np.empty(n, np.float32) if mode else None
                    K.launch_chunk_norms(g2, r, mom, mom_out, mode, 0.9, c, l2, norms2, vout=vout,
                                         zero_g=True)
                    same_bits(torch.from_numpy(vout), tv2)
                    same_bits(torch.from_numpy(g2), tg2)
                    torch.testing.assert_close(torch.from_numpy(norms2), ref2, rtol=1e-5, atol=1e-5)
                    if r is not None:  # v over the residual it reads (the in-place state)
                        r3 = r.copy()
                        K.launch_chunk_norms(g3, r3, mom, np.empty(n, np.float32) if mode else None,
                                             mode, 0.9, c, l2, norms2, vout=r3, zero_g=True)
                        same_bits(torch.from_numpy(r3), tv2)
                    cases += 1
        for wd in (torch.float32, torch.float16, torch.bfloat16):
            v = rng.standard_normal(n).astype(np.float32) * 100
            v[: min(n, special.size)] = special[: min(n, special.size)]
            for k in sorted({1, nch}):  # k = 0 is covered by the CPU tests
                k = min(k, nch)
                idx = np.sort(rng.choice(nch, size=k, replace=False)).astype(np.int64)
                tidx = torch.from_numpy(idx)
                ref_p = R.pack_chunks(torch.from_numpy(v), tidx, c, 0.5, wd)
                out = np.empty(k * c, np.float32 if wd == torch.float32 else np.uint16)
                K.launch_pack(v, idx, c, 0.5, CODE[wd], out)
                same_bits(from_wire(out, wd), ref_p)
                # unpack: residual on/off, local on/off, aliasing out=v
                red = ref_p.clone()
                for has_r in (False, True):
                    for has_loc in (False, True):
                        for alias in ((False, True) if has_r and has_loc else (False,)):
                            tv = torch.from_numpy(v.copy())
                            tr = torch.zeros(n) if has_r else None
                            tout = tv if alias else torch.empty(n)
                            R.unpack_update(tv.clone() if alias else tv, tr, red,
                                            ref_p if has_loc else None, tidx, c, 2.0, 2.0,
                                            out=tout)
                            nv = v.copy()
                            nr = np.zeros(n, np.float32) if has_r else None
                            nout = nv if alias else np.empty(n, np.float32)
                            cmap = np.full(nch, -1, np.int64)
                            cmap[idx] = np.arange(k)
                            K.launch_unpack(nv, nr, wire_np(red), CODE[wd],
                                            wire_np(ref_p) if has_loc else None, CODE[wd],
                                            cmap, c, 2.0, 2.0, nout)
                            same_bits(torch.from_numpy(nout), tout)
                            if has_r:
                                same_bits(torch.from_numpy(nr), tr)
                            cases += 1
            # dense helpers
            ref_c = R.cast_scaled(torch.from_numpy(v), 0.25, wd)
            out = np.empty(n, np.float32 if wd == torch.float32 else np.uint16)
            K.launch_cast(v, 0.25, CODE[wd], out)
            same_bits(from_wire(out, wd), ref_c)
            up = np.empty(n, np.float32)
            K.launch_upcast(wire_np(ref_c), CODE[wd], 4.0, up)
            same_bits(torch.from_numpy(up), R.upcast_scaled(ref_c, 4.0, out=torch.empty(n)))
    print(f"OK {cases} cases")


if __name__ == "__main__":
    main()
