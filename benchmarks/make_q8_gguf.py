"""Write a Q8_0 GGUF of the default model (from its Q4_1 GGUF), for llama.cpp's int8 figure.

The default model ships only as Q4_1. Its Q4_1 weights are dequantized and requantized to
Q8_0 block by block with the ``gguf`` package (every value of a Q4_1 block sits on a grid that
Q8_0 holds almost exactly), the metadata copied as is. Only for the benchmark: llama.cpp's
speed on Q8_0 weights of the same model, beside our int8 fast path.

    python benchmarks/make_q8_gguf.py --out /tmp/smollm2-135m-q8_0.gguf
    python benchmarks/fast_path.py --gguf-q8 /tmp/smollm2-135m-q8_0.gguf
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np

from engine.models import default_model

REQUANTIZED = (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q5_1,
               gguf.GGMLQuantizationType.Q5_0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    default_model.ensure()
    reader = gguf.GGUFReader(str(default_model.gguf_path()))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(args.out, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    tensors = []
    for tensor in reader.tensors:
        if tensor.tensor_type in REQUANTIZED:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            data, kind = gguf.quants.quantize(values.astype(np.float32), gguf.GGMLQuantizationType.Q8_0), \
                gguf.GGMLQuantizationType.Q8_0
        else:
            data, kind = tensor.data, tensor.tensor_type
        tensors.append((tensor.name, data, kind))
        writer.add_tensor_info(tensor.name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
