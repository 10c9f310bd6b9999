#!/usr/bin/env python3
"""Golden files for Chimera's FP8 E4M3 / E2M1 / NVFP4 code (src/core/fp8.h, src/core/nvfp4.h), made by torch's
float8_e4m3fn casts and NVIDIA ModelOpt's own NVFP4 quantizer, on the CPU.

Writes into --out (default tests/fixtures/quant/), every array a little-endian .npy (bytes stored as int32):
  e4m3_decode.npy        f32 [256]   torch: uint8 0..255 viewed as float8_e4m3fn, to float32
  e4m3_encode_in.npy     f32 [N]     awkward floats: ties, subnormals, the overflow edge, infinities, NaN, +-0
  e4m3_encode_cast.npy   i32 [N]     torch: x.to(float8_e4m3fn) (the plain cast: > 464 becomes NaN)
  e4m3_encode_sat.npy    i32 [N]     torch: x.clamp(-448, 448).to(float8_e4m3fn) (what ModelOpt's quantizers do)
  e2m1_decode.npy        f32 [16]    ModelOpt's e2m1_values table (code -> value)
  e2m1_encode_in.npy     f32 [M]     awkward floats: every midpoint, its neighbours, beyond 6
  e2m1_encode.npy        i32 [M]     ModelOpt: NVFP4QTensor._cast_fp4 (the 4-bit code, sign in bit 3)
  nvfp4_w.npy            f32 [R, C]  a weight with an all-zero block, a tiny block and a wide range
  nvfp4_packed.npy       i32 [R, C/2]   ModelOpt NVFP4QTensor.quantize(w, 16): packed bytes
  nvfp4_scale.npy        i32 [R, C/16]  its per-block e4m3 scale bytes (weight_scale)
  nvfp4_scale_2.npy      f32 [1]        its weight_scale_2
  nvfp4_dequant.npy      f32 [R, C]     ModelOpt NVFP4QTensor.dequantize(float32)
  fp8_w.npy              f32 [R, C]  a weight
  fp8_weight.npy         i32 [R, C]  ModelOpt's export (quant_utils.to_quantized_weight, "fp8") with
  fp8_scale.npy          f32 [1]     weight_scale = amax / 448
  fp8_x.npy, fp8_input_scale.npy, fp8_x_fq.npy   activations, input_scale = amax / 448 and
                                     (x / input_scale).clamp(-448, 448).to(e4m3).float() * input_scale
  info.json              versions and counts

Usage: python3 scripts/make_quant_fixtures.py [--out tests/fixtures/quant]
Needs torch and nvidia-modelopt (CPU wheels are enough; the fixtures were made with the versions in info.json).
"""

import argparse
import json
import os

import numpy as np
import torch

E4M3 = torch.float8_e4m3fn


def save(out, name, a):
    np.save(os.path.join(out, name), np.ascontiguousarray(a))


def bytes_i32(t):
    return t.view(torch.uint8).to(torch.int32).numpy()


def e4m3_inputs():
    vals = [0.0, -0.0, 1.0, -1.0, 448.0, -448.0, 449.0, 463.9, 464.0, 464.1, 479.0, 480.0, 500.0, 1e6, -1e6,
            float("inf"), float("-inf"), float("nan"), 2.0 ** -6, 2.0 ** -7, 2.0 ** -9, 2.0 ** -10, 1.5 * 2.0 ** -10,
            2.0 ** -11, 3 * 2.0 ** -10, 1e-30, -1e-30, 1e-45, 0.1, 0.3, 1.0625, 1.1875, 1.0624, 1.0626, 17.0, 19.0,
            240.0, 232.0, 248.0, 0.013671875, 0.0146484375, 0.0009765625]
    # every midpoint between consecutive finite e4m3 values, and a hair either side of it
    pos = torch.arange(0, 0x7F, dtype=torch.uint8).view(E4M3).float()
    mids = ((pos[:-1].double() + pos[1:].double()) / 2).float()
    for m in mids.tolist():
        vals += [m, -m, float(np.nextafter(np.float32(m), np.float32(0))),
                 float(np.nextafter(np.float32(m), np.float32(1e9)))]
    g = torch.Generator().manual_seed(22)
    vals += (torch.randn(200, generator=g) * torch.exp2(torch.randint(-12, 10, (200,), generator=g).float())).tolist()
    return torch.tensor(vals, dtype=torch.float32)


def e2m1_inputs():
    vals = [0.0, -0.0, 6.0, -6.0, 7.0, 100.0, -100.0, 1e-8, -1e-8, -0.1, 0.1]
    for m in [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]:
        for v in [m, float(np.nextafter(np.float32(m), np.float32(0))), float(np.nextafter(np.float32(m), np.float32(9)))]:
            vals += [v, -v]
    g = torch.Generator().manual_seed(23)
    vals += (torch.rand(100, generator=g) * 14 - 7).tolist()
    return torch.tensor(vals, dtype=torch.float32)


def nvfp4_weight():
    g = torch.Generator().manual_seed(24)
    rows, cols = 7, 80
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[1, 16:32] = 0.0                       # an all-zero block: its scale is stored as 1
    w[2, 32:48] *= 1e-6                      # a tiny block: its scale clamps to e4m3's smallest subnormal
    w[3, 0] = 3.0                            # the tensor's amax: one block at scale 448
    w[4, 48:64] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * (3.0 / 6.0 / 448.0) * 100
    w[5] *= 20.0
    return w


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/fixtures/quant")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(1)

    from modelopt.torch.export.quant_utils import to_quantized_weight
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    import modelopt

    # E4M3
    save(args.out, "e4m3_decode.npy", torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float().numpy())
    x = e4m3_inputs()
    save(args.out, "e4m3_encode_in.npy", x.numpy())
    save(args.out, "e4m3_encode_cast.npy", bytes_i32(x.to(E4M3)))
    save(args.out, "e4m3_encode_sat.npy", bytes_i32(x.clamp(-448.0, 448.0).to(E4M3)))

    # E2M1
    save(args.out, "e2m1_decode.npy", NVFP4QTensor.get_e2m1_values(torch.device("cpu")).float().numpy())
    y = e2m1_inputs()
    save(args.out, "e2m1_encode_in.npy", y.numpy())
    save(args.out, "e2m1_encode.npy", NVFP4QTensor._cast_fp4(y.clone()).to(torch.int32).numpy())

    # NVFP4 weight quantization and dequantization, ModelOpt's own code
    w = nvfp4_weight()
    qt, scale, scale_2 = NVFP4QTensor.quantize(w, 16)
    deq = qt.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
    save(args.out, "nvfp4_w.npy", w.numpy())
    save(args.out, "nvfp4_packed.npy", qt._quantized_data.to(torch.int32).numpy())
    save(args.out, "nvfp4_scale.npy", bytes_i32(scale))
    save(args.out, "nvfp4_scale_2.npy", scale_2.float().reshape(1).numpy())
    save(args.out, "nvfp4_dequant.npy", deq.numpy())

    # FP8 per-tensor weight (ModelOpt's export of quant_algo FP8) and static activation fake quantization
    g = torch.Generator().manual_seed(25)
    fw = torch.randn(9, 37, generator=g) * 0.2
    fw[0, 0] = -1.7
    fscale = fw.abs().amax().float() / 448.0
    fq = to_quantized_weight(fw, fscale, "fp8")
    save(args.out, "fp8_w.npy", fw.numpy())
    save(args.out, "fp8_weight.npy", bytes_i32(fq))
    save(args.out, "fp8_scale.npy", fscale.reshape(1).numpy())
    fx = torch.randn(5, 37, generator=g) * 2.0
    in_scale = torch.tensor(3.0 / 448.0)  # a calibrated amax of 3: |x| above it saturates
    fx_fq = (fx / in_scale).clamp(-448.0, 448.0).to(E4M3).float() * in_scale
    save(args.out, "fp8_x.npy", fx.numpy())
    save(args.out, "fp8_input_scale.npy", in_scale.reshape(1).numpy())
    save(args.out, "fp8_x_fq.npy", fx_fq.numpy())

    info = {
        "torch": torch.__version__,
        "modelopt": modelopt.__version__,
        "numpy": np.__version__,
        "e4m3_inputs": int(x.numel()),
        "e2m1_inputs": int(y.numel()),
        "nvfp4_shape": list(w.shape),
        "fp8_shape": list(fw.shape),
    }
    with open(os.path.join(args.out, "info.json"), "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    print(json.dumps(info))


if __name__ == "__main__":
    main()
