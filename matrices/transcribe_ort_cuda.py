"""Write ``matrices/ort-cuda.yaml`` from a transcription of ONNX Runtime's ``docs/OperatorKernels.md`` (CUDA EP).

Run ``python -m onnxdeploy.matrices.transcribe_ort_cuda [--output PATH]``. The installed onnxruntime wheel is
CPU-only (it registers CPU kernels only), so the CUDA entry cannot be generated from a kernel registry like
``ort-cpu``; it comes from the document ORT generates from its registered kernels
(``tools/python/gen_opkernel_doc.py``), section "Operators implemented by CUDAExecutionProvider".

:data:`TABLE` below is that section transcribed by hand, one line per kernel registration:
``Op|versions|Param=type,type;Param=...`` where ``versions`` is ``N+`` (N and later), ``N-M`` or ``N``, and
the macros ``ALL13``, ``F8``, ``F3`` and ``F4`` expand as in :data:`MACROS`. What was left out on purpose:
types of sequence/optional-typed parameters (``V`` of Identity/If/Loop/Scan 19+, ``S`` of Sequence* ops,
Memcpy*: rows kept without those types), the ``indices``/``shape`` pseudo-parameters (fixed int64 in the
schema), and the internal ``com.ms.internal.nhwc`` domain (ORT's layout transformer writes it, models do not).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from onnxdeploy.matrices.generate_ort_cpu import _dump
from onnxdeploy.matrices.generate_ort_mobile import CONSTANT_ENTRY, ORT_GRAPH_SOURCE
from onnxdeploy.matrices.schema import Matrix

__all__ = ["MACROS", "TABLE", "build_matrix", "main", "parse_table"]

READ = "2026-12-01"
"""Date the document was read."""

COMMIT = "001d12d2623fd411ce0f83d05abb5e82304a3389"
"""Commit of microsoft/onnxruntime whose docs/OperatorKernels.md was read (the copy in the public code index)."""

MACROS: dict[str, str] = {
    "ALL13": "bfloat16,bool,double,float,float16,int16,int32,int64,int8,uint16,uint32,uint64,uint8",
    "F8": "float8e4m3fn,float8e4m3fnuz,float8e5m2,float8e5m2fnuz",
    "F3": "double,float,float16",
    "F4": "bfloat16,double,float,float16",
}

_I12 = "bfloat16,double,float,float16,int16,int32,int64,int8,uint16,uint32,uint64,uint8"
_I8 = "bfloat16,double,float,float16,int32,int64,uint32,uint64"
_I7 = "double,float,float16,int32,int64,uint32,uint64"
_CAST_T2 = (
    "bfloat16,bool,double,float,float16,float4e2m1,float8e4m3fn,float8e5m2,int16,int32,int64,int8,uint16,uint32,uint64,"
    "uint8"
)
_CAST_T1_FP8 = (
    "bfloat16,bool,double,float,float16,float8e4m3fn,float8e5m2,int16,int32,int64,int8,uint16,uint32,uint64,uint8"
)
_CAST_T1_OLD = "bool,double,float,float16,int16,int32,int64,int8,uint16,uint32,uint64,uint8"

TABLE_AI_ONNX = f"""
Abs|13+|T={_I12}
Abs|6-12|T=double,float,float16,int16,int32,int64,int8,uint16,uint32,uint64,uint8
Add|14+|T={_I12}
Add|13|T={_I8}
Add|7-12|T={_I7}
Affine|1+|T=F3
And|7+|T=bool;T1=bool
ArgMax|13+|T=F3
ArgMax|12|T=F3
ArgMax|1-11|T=F3
ArgMin|13+|T=F3
ArgMin|12|T=F3
ArgMin|1-11|T=F3
Attention|24+|T1=bfloat16,float,float16;T2=bfloat16,float,float16;U=bfloat16,bool,float,float16
Attention|23|T1=bfloat16,float,float16;T2=bfloat16,float,float16;U=bfloat16,bool,float,float16
AveragePool|22+|T=F4
AveragePool|19-21|T=F3
AveragePool|11-18|T=F3
AveragePool|10|T=F3
AveragePool|7-9|T=F3
BatchNormalization|15+|T=F3;T1=F3;T2=F3
BatchNormalization|14|T=F3;U=F3
BatchNormalization|9-13|T=F3
BatchNormalization|7-8|T=F3
Cast|23+|T1={_CAST_T2};T2={_CAST_T2}
Cast|21-22|T1={_CAST_T1_FP8};T2={_CAST_T2}
Cast|19-20|T1={_CAST_T1_FP8};T2={_CAST_T2}
Cast|13-18|T1=ALL13;T2={_CAST_T2}
Cast|9-12|T1={_CAST_T1_OLD};T2={_CAST_T2}
Cast|6-8|T1={_CAST_T1_OLD};T2={_CAST_T2}
Ceil|13+|T=F3
Ceil|6-12|T=F3
Clip|13+|T=double,float,float16,int64,int8,uint64,uint8
Clip|12|T=double,float,float16,int64,int8,uint64,uint8
Clip|11|T=float
Clip|6-10|T=float
Compress|11+|T=ALL13;T1=bool
Compress|9-10|T=ALL13;T1=bool
Concat|13+|T=ALL13
Concat|11-12|T=ALL13
Concat|4-10|T=ALL13
ConcatFromSequence|11+|
ConstantOfShape|9+|T1=int64;T2=ALL13
Conv|22+|T=F4
Conv|11-21|T=F3
Conv|1-10|T=F3
ConvTranspose|11+|T=F3
ConvTranspose|1-10|T=F3
Cos|7+|T=F3
Crop|1+|T=F3
CumSum|14+|T=double,float,float16,int32,int64,uint32,uint64;T2=int32,int64
CumSum|11-13|T=double,float,int32,int64,uint32,uint64;T2=int32,int64
DepthToSpace|13+|T=F3
DepthToSpace|11-12|T=F3
DepthToSpace|1-10|T=F3
DequantizeLinear|21+|T1=float8e4m3fn,float8e5m2,int4,int8,uint4,uint8;T2=float,float16
DequantizeLinear|19-20|T1=float8e4m3fn,float8e5m2,int8,uint8;T2=float,float16
DequantizeLinear|13-18|T=int8,uint8
DequantizeLinear|10-12|T=int8,uint8
Div|14+|T={_I12}
Div|13|T={_I8}
Div|7-12|T={_I7}
Dropout|13+|T=F4;T1=F4;T2=bool
Dropout|12|T=F3;T1=F3;T2=bool
Dropout|10-11|T=F3;T1=bool
Dropout|7-9|T=F3
DynamicSlice|1+|T=ALL13;Tind=int32,int64
Einsum|12+|T=F3
Elu|6+|T=F3
Equal|13+|T=bool,double,float,float16,int32,int64,uint32,uint64;T1=bool
Equal|11-12|T=bool,double,float,float16,int32,int64,uint32,uint64
Equal|7-10|T=bool,int32,int64
Erf|13+|T=F4
Erf|9-12|T=F3
Exp|13+|T=F4
Exp|6-12|T=F3
Expand|13+|T=ALL13
Expand|8-12|T=ALL13
EyeLike|9+|T1=double,float,int32,int64,uint64;T2=double,float,int32,int64,uint64
Flatten|13+|T=ALL13
Flatten|11-12|T=ALL13
Flatten|9-10|T=ALL13
Flatten|1-8|T=ALL13
Floor|13+|T=F3
Floor|6-12|T=F3
GRU|14+|T=F3;T1=int32
GRU|7-13|T=F3;T1=int32
Gather|13+|T=ALL13;Tind=int32,int64
Gather|11-12|T=ALL13;Tind=int32,int64
Gather|1-10|T=ALL13;Tind=int32,int64
GatherElements|13+|T=ALL13;Tind=int32,int64
GatherElements|11-12|T=ALL13;Tind=int32,int64
GatherND|13+|T=bfloat16,bool,double,float,float16,int64
GatherND|12|T=bool,double,float,float16,int64
GatherND|11|T=bool,double,float,float16,int64
Gelu|20+|T=F4
Gemm|13+|T=F4
Gemm|11-12|T=F3
Gemm|9-10|T=F3
Gemm|7-8|T=F3
GlobalAveragePool|1+|T=F3
GlobalMaxPool|1+|T=F3
Greater|13+|T={_I7};T1=bool
Greater|9-12|T={_I7}
Greater|7-8|T=F3
GreaterOrEqual|16+|T={_I7};T1=bool
GreaterOrEqual|12-15|T={_I7};T1=bool
GridSample|22+|T1=float;T2=float
GridSample|20-21|T1=float;T2=float
GridSample|16-19|T1=float;T2=float
HardSigmoid|22+|T=F4
HardSigmoid|6-21|T=F3
HardSwish|22+|T=F4
HardSwish|14-21|T=F3
Identity|19+|
Identity|14-18|
Identity|13|T=ALL13
Identity|1-12|T=ALL13
If|19+|B=bool
If|13-18|B=bool
If|11-12|B=bool;V=ALL13
If|1-10|B=bool;V=ALL13
ImageScaler|1+|T=F3
InstanceNormalization|6+|T=F3
IsInf|20+|T1=bfloat16,double,float,float16,F8;T2=bool
IsInf|10-19|T1=double,float;T2=bool
IsNaN|20+|T1=bfloat16,double,float,float16,F8;T2=bool
IsNaN|13-19|T1=F4;T2=bool
IsNaN|9-12|T1=F3;T2=bool
LRN|13+|T=F3
LRN|1-12|T=F3
LSTM|14+|T=F3;T1=int32
LSTM|7-13|T=F3;T1=int32
LayerNormalization|17+|T=F4;U=float
LayerNormalization|1-16|T=F4;U=double,float;V=F4
LeakyRelu|16+|T=F3
LeakyRelu|6-15|T=F3
Less|13+|T={_I7};T1=bool
Less|9-12|T={_I7}
Less|7-8|T=F3
LessOrEqual|16+|T={_I7};T1=bool
LessOrEqual|12-15|T={_I7};T1=bool
Log|13+|T=F3
Log|6-12|T=F3
LogSoftmax|13+|T=F3
LogSoftmax|11-12|T=F3
LogSoftmax|1-10|T=F3
Loop|19+|B=bool;I=int64
Loop|13-18|B=bool;I=int64
Loop|11-12|B=bool;I=int64;V=ALL13
Loop|1-10|B=bool;I=int64;V=ALL13
MatMul|13+|T=F4
MatMul|9-12|T=F3
MatMul|1-8|T=F3
MatMulInteger|10+|T1=int8;T2=int8;T3=int32
Max|13+|T={_I8}
Max|12|T={_I8}
Max|6-11|T=F4
MaxPool|12+|I=int64;T=double,float,float16,int8,uint8
MaxPool|11|I=int64;T=F3
MaxPool|10|I=int64;T=F3
MaxPool|8-9|I=int64;T=F3
MaxPool|1-7|T=F3
MemcpyFromHost|1+|
MemcpyToHost|1+|
Min|13+|T={_I8}
Min|12|T={_I8}
Min|6-11|T=F4
Mod|13+|T={_I8}
Mod|10-12|T={_I7}
Mul|14+|T={_I12}
Mul|13|T={_I8}
Mul|7-12|T={_I7}
Neg|13+|T=bfloat16,double,float,float16,int16,int32,int64,int8
Neg|6-12|T=double,float,float16,int16,int32,int64,int8
NonZero|13+|T=bool,float,float16,int32,int64,uint8
NonZero|9-12|T=bool,float,float16,int32,int64,uint8
Not|1+|T=bool
OneHot|11+|T1=int32,int64;T2=int32,int64;T3=float,float16,int64
Or|7+|T=bool;T1=bool
PRelu|16+|T=F3
PRelu|9-15|T=F3
PRelu|7-8|T=F3
Pad|18+|T=bool,double,float,float16
Pad|13-17|T=bool,double,float,float16
Pad|11-12|T=F3
Pad|2-10|T=F3
ParametricSoftplus|1+|T=F3
Pow|15+|T=bfloat16,double,float,float16,int32,int64;T1=bfloat16,double,float,float16,int32,int64
Pow|13-14|T=bfloat16,double,float,float16,int32,int64;T1=double,float,float16,int32,int64
Pow|12|T=double,float,float16,int32,int64;T1=double,float,float16,int32,int64
Pow|7-11|T=F3
QuantizeLinear|21+|T1=float,float16;T2=float8e4m3fn,float8e5m2,int4,int8,uint4,uint8
QuantizeLinear|19-20|T1=float,float16;T2=float8e4m3fn,float8e5m2,int8,uint8
QuantizeLinear|13-18|T1=float;T2=int8,uint8
QuantizeLinear|10-12|T1=float;T2=int8,uint8
RMSNormalization|23+|T=F4;V=F4
RNN|14+|T=F3;T1=int32
RNN|7-13|T=F3;T1=int32
RandomNormal|1+|T=F3
RandomNormalLike|1+|T1=ALL13,string;T2=F3
RandomUniform|1+|T=F3
RandomUniformLike|1+|T1=ALL13,string;T2=F3
Range|11+|T=double,float,int16,int32,int64
Reciprocal|13+|T=F3
Reciprocal|6-12|T=F3
ReduceL1|18+|T=double,float,float16,int32
ReduceL1|1-17|T=double,float,float16,int32
ReduceL2|18+|T=double,float,float16,int32
ReduceL2|1-17|T=double,float,float16,int32
ReduceLogSum|18+|T=F3
ReduceLogSum|1-17|T=F3
ReduceLogSumExp|18+|T=F3
ReduceLogSumExp|1-17|T=F3
ReduceMax|18+|T=double,float,float16,int32,int64
ReduceMax|1-17|T=double,float,float16,int32,int64
ReduceMean|18+|T=double,float,float16,int32
ReduceMean|1-17|T=double,float,float16,int32
ReduceMin|18+|T=double,float,float16,int32,int64,int8,uint8
ReduceMin|1-17|T=double,float,float16,int32,int64,int8,uint8
ReduceProd|18+|T=double,float,float16,int32
ReduceProd|1-17|T=double,float,float16,int32
ReduceSum|13+|T=bfloat16,double,float,float16,int32,int64
ReduceSum|1-12|T=double,float,float16,int32,int64
ReduceSumSquare|18+|T=F3
ReduceSumSquare|1-17|T=F3
Relu|14+|T=F4
Relu|13|T=F4
Relu|6-12|T=F3
Reshape|23+|T=ALL13,F8
Reshape|21-22|T=ALL13,F8
Reshape|19-20|T=ALL13,F8
Reshape|14-18|T=ALL13
Reshape|13|T=ALL13
Reshape|5-12|T=ALL13
Reshape|1-4|T=ALL13
Resize|19+|T1=double,float,float16,int32,uint8
Resize|18|T1=double,float,float16,int32,uint8
Resize|13-17|T1=double,float,float16,int32,uint8
Resize|11-12|T1=double,float,float16,int32,uint8
Resize|10|T=double,float,float16,int32,uint8
ReverseSequence|10+|T=ALL13
RoiAlign|10+|T1=double,float;T2=int64
RotaryEmbedding|23+|M=int64;T=bfloat16,float,float16
Round|11+|T=F3
ScaledTanh|1+|T=F3
Scan|19+|V=ALL13,F8
Scan|16-18|V=ALL13
Scan|11-15|V=ALL13
Scan|9-10|V=ALL13
Scan|8|I=int64;V=ALL13,string
Scatter|9-10|T=ALL13;Tind=int32,int64
ScatterElements|18+|T=ALL13;Tind=int32,int64
ScatterElements|16-17|T=ALL13;Tind=int32,int64
ScatterElements|13-15|T=ALL13;Tind=int32,int64
ScatterElements|11-12|T=ALL13;Tind=int32,int64
ScatterND|18+|T=ALL13
ScatterND|16-17|T=ALL13
ScatterND|13-15|T=ALL13
ScatterND|11-12|T=ALL13
Selu|6+|T=F3
SequenceAt|11+|I=int32,int64;T=ALL13
SequenceConstruct|11+|T=ALL13
SequenceEmpty|11+|
SequenceErase|11+|I=int32,int64
SequenceInsert|11+|I=int32,int64;T=ALL13
SequenceLength|11+|I=int64
Shape|23+|T=ALL13,F8;T1=int64
Shape|21-22|T=ALL13,F8;T1=int64
Shape|19-20|T=ALL13,F8;T1=int64
Shape|15-18|T=ALL13;T1=int64
Shape|13-14|T=ALL13;T1=int64
Shape|1-12|T=ALL13;T1=int64
Shrink|9+|T=double,float,float16,int16,int32,int64,int8,uint16,uint32,uint64,uint8
Sigmoid|13+|T=F4
Sigmoid|6-12|T=F3
Sign|13+|T={_I12}
SimplifiedLayerNormalization|1+|T=F4;U=double,float;V=F4
Sin|7+|T=F3
Size|13+|T=ALL13,string;T1=int64
Size|1-12|T=ALL13,string;T1=int64
Slice|13+|T=ALL13;Tind=int32,int64
Slice|11-12|T=ALL13;Tind=int32,int64
Slice|10|T=ALL13;Tind=int32,int64
Slice|1-9|T=ALL13
Softmax|13+|T=F4
Softmax|11-12|T=F3
Softmax|1-10|T=F3
Softplus|1+|T=F3
Softsign|1+|T=F3
SpaceToDepth|13+|T=F3
SpaceToDepth|1-12|T=F3
Split|18+|T=ALL13
Split|13-17|T=ALL13
Split|11-12|T=ALL13
Split|2-10|T=ALL13
Sqrt|13+|T=F4
Sqrt|6-12|T=F3
Squeeze|23+|T=ALL13
Squeeze|21-22|T=ALL13
Squeeze|13-20|T=ALL13
Squeeze|11-12|T=ALL13
Squeeze|1-10|T=ALL13
Sub|14+|T={_I12}
Sub|13|T={_I8}
Sub|7-12|T={_I7}
Sum|13+|T=F4
Sum|8-12|T=F4
Sum|6-7|T=F4
Tanh|13+|T=F4
Tanh|6-12|T=F3
TensorScatter|24+|T=ALL13
ThresholdedRelu|10+|T=F3
ThresholdedRelu|1+|T=F3
Tile|13+|T=bfloat16,double,float,float16,int32,int64;T1=int64
Tile|6-12|T=double,float,float16,int32,int64;T1=int64
TopK|11+|I=int64;T=double,float,float16,int32,int64
TopK|10|I=int64;T=double,float,float16,int32,int64
TopK|1-9|T=double,float,float16,int32,int64
Transpose|23+|T=ALL13
Transpose|21-22|T=ALL13
Transpose|13-20|T=ALL13
Transpose|1-12|T=ALL13
Trilu|14+|T=ALL13
Unsqueeze|23+|T=ALL13
Unsqueeze|21-22|T=ALL13
Unsqueeze|13-20|T=ALL13
Unsqueeze|11-12|T=ALL13
Unsqueeze|1-10|T=ALL13
Upsample|9|T=double,float,float16,int32,uint8
Upsample|7-8|T=double,float,float16,int32,uint8
Where|16+|B=bool;T=bfloat16,double,float,float16,int32,int64,uint8
Where|9-15|B=bool;T=double,float,float16,int32,int64,uint8
Xor|7+|T=bool;T1=bool
"""

TABLE_COM_MICROSOFT = """
Attention|1+|T=bfloat16,float,float16
BeamSearch|1+|T=float,float16
BiasAdd|1+|T=float,float16
BiasDropout|1+|T=F4;T1=F4;T2=bool
BiasGelu|1+|T=F4
BiasSoftmax|1+|T=F3
BiasSplitGelu|1+|T=float,float16
BitmaskBiasDropout|1+|T=F4;T1=F4;T2=bool;T3=uint32
BitmaskDropout|1+|T=F4;T1=F4;T2=bool;T3=uint32
ComplexMul|1+|T=float,float16
ComplexMulConj|1+|T=float,float16
ConvTransposeWithDynamicPads|1+|T=float
DecoderAttention|1+|T=float,float16
DecoderMaskedMultiHeadAttention|1+|QK=float,float16;T=float,float16
DecoderMaskedSelfAttention|1+|T=float,float16
DequantizeLinear|1+|T1=int8,uint8;T2=float16
DequantizeWithOrder|1+|F=float,float16;Q=int8;S=float
DynamicTimeWarping|1+|F=float;I=int32
EmbedLayerNormalization|1+|T=float,float16
FastGelu|1+|T=F4
FusedConv|1+|T=float
FusedMatMul|1+|T=F4
GatedRelativePositionBias|1+|T=float,float16
GatherBlockQuantized|1+|T1=int4,uint4,uint8;T2=bfloat16,float,float16;Tind=int32,int64
Gelu|1+|T=F4
GemmFloat8|1+|TA=bfloat16,float,float16,float8e4m3fn,float8e5m2;TB=bfloat16,float,float16,float8e4m3fn,float8e5m2;TR=bfloat16,float,float16,float8e4m3fn,float8e5m2;TS=float
GemmaRotaryEmbedding|1+|T=float16;U=float
GreedySearch|1+|T=float,float16
GridSample|1+|T1=float;T2=float
GroupNorm|1+|T=float,float16
GroupQueryAttention|1+|M=int32;T=bfloat16,float16;T_CACHE=bfloat16,float16,float8e4m3fn,int8;T_KV_SCALE=float
Inverse|1+|T=F3
Irfft|1+|T=F3
LongformerAttention|1+|T=float,float16
MatMulBnb4|1+|T1=bfloat16,float,float16;T2=uint8
MatMulNBits|1+|T1=bfloat16,float,float16;T2=uint8;T3=bfloat16,float,float16,uint8
MoE|1+|T=bfloat16,float,float16
MultiHeadAttention|1+|QK=bfloat16,float,float16;T=bfloat16,float,float16
NGramRepeatBlock|1+|T=float;Tid=int64
NhwcConv|1+|T=float,float16
PackedAttention|1+|T=float,float16
PackedMultiHeadAttention|1+|T=float,float16
PagedAttention|1+|S=int32;T=bfloat16,float16
QAttention|1+|T1=int8;T2=int8;T3=float,float16;T4=int32
QMoE|1+|T=bfloat16,float16;T1=uint8;T2=bfloat16,float16
QOrderedAttention|1+|G=int32;Q=int8;S=float
QOrderedGelu|1+|Q=int8;S=float
QOrderedLayerNormalization|1+|F=float,float16;Q=int8;S=float
QOrderedLongformerAttention|1+|F=float16;G=int32;Q=int8;S=float
QOrderedMatMul|1+|Q=int8;S=float
QuantizeLinear|1+|T1=float16;T2=int8,uint8
QuantizeWithOrder|1+|F=float,float16;Q=int8;S=float
QuickGelu|1+|T=F4
RelativePositionBias|1+|T=float,float16
RemovePadding|1+|T=float,float16
RestorePadding|1+|T=float,float16
Rfft|1+|T=F3
RotaryEmbedding|1+|M=int64;T=bfloat16,float,float16
Sampling|1+|T=float,float16
SkipGroupNorm|1+|T=float,float16
SkipLayerNormalization|1+|T=bfloat16,float,float16
SkipSimplifiedLayerNormalization|1+|T=bfloat16,float,float16
SparseAttention|1+|M=int32;T=bfloat16,float16
TransposeMatMul|1+|T=F4
Trilu|1+|T=ALL13
UnfoldTensor|1+|T=ALL13,string
WhisperBeamSearch|1+|T=float,float16
"""

TABLE = {"ai.onnx": TABLE_AI_ONNX, "com.microsoft": TABLE_COM_MICROSOFT}
"""Domain -> transcribed rows."""


def _types(spec: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for part in filter(None, spec.split(";")):
        param, _, names = part.partition("=")
        expanded: list[str] = []
        for name in names.split(","):
            expanded += MACROS[name].split(",") if name in MACROS else [name]
        out[param] = sorted(set(expanded))
    return out


def parse_table(domain: str, text: str) -> list[dict]:
    """Parse transcribed rows ``Op|versions|types`` of one domain into op entries (``via: kernel``).

    Raises:
        ValueError: a row does not have three ``|``-separated fields or a malformed version span.
    """
    entries = []
    for line in filter(None, (raw.strip() for raw in text.splitlines())):
        op, versions, types = line.split("|")
        if versions.endswith("+"):
            since, until = int(versions[:-1]), None
        elif "-" in versions:
            lo, hi = versions.split("-")
            since, until = int(lo), int(hi)
        else:
            since = until = int(versions)
        entry: dict = {"op": op, "domain": domain, "since": since}
        if until is not None:
            entry["until"] = until
        entry["via"] = "kernel"
        if types:
            entry["types"] = _types(types)
        entry["source"] = "ort-kernels-md"
        entries.append(entry)
    return sorted(entries, key=lambda e: (e["domain"], e["op"], e["since"]))


def build_matrix() -> dict:
    """Build the ``ort-cuda`` matrix as a plain mapping (validated against :class:`Matrix`)."""
    ops = [e for domain, text in TABLE.items() for e in parse_table(domain, text)] + [CONSTANT_ENTRY]
    address = f"https://github.com/microsoft/onnxruntime/blob/{COMMIT}/docs/OperatorKernels.md"
    data = {
        "schema_version": 1,
        "target": "ort-cuda",
        "name": "ONNX Runtime, CUDA execution provider",
        "kind": "execution_provider",
        "description": "ONNX Runtime's CUDAExecutionProvider (onnxruntime-gpu): an op/type pair listed here has a "
        "CUDA kernel; other nodes run on the CPU EP (with copies between device and host) unless CPU fallback is "
        "disabled. Transcribed from docs/OperatorKernels.md, which ORT generates from its registered kernels.",
        "product_version": f"onnxruntime (docs/OperatorKernels.md at {COMMIT[:8]})",
        "execution_provider": "CUDAExecutionProvider",
        "opsets": {
            "ai.onnx": {"min": 7, "max": 24, "source": "ort-kernels-md"},
            "com.microsoft": {"min": 1, "max": 1, "source": "ort-kernels-md"},
        },
        "dtypes": {
            "fp16": {"supported": "partial", "source": "ort-kernels-md", "note": "most math kernels take float16"},
            "bf16": {"supported": "partial", "source": "ort-kernels-md", "note": "a subset (e.g. MatMul 13+, Add 13+)"},
            "int8": {
                "supported": "partial",
                "source": "ort-kernels-md",
                "note": "QDQ (QuantizeLinear/DequantizeLinear), MatMulInteger, com.microsoft QAttention/QOrdered*",
            },
            "int4": {
                "supported": "partial",
                "source": "ort-kernels-md",
                "note": "DequantizeLinear 21+ int4/uint4; com.microsoft MatMulNBits (uint8-packed), "
                "GatherBlockQuantized",
            },
        },
        "limits": [],
        "ops_complete": True,
        "ops": ops,
        "sources": {
            "ort-graph": ORT_GRAPH_SOURCE | {"read": READ},
            "ort-kernels-md": {
                "doc": "ONNX Runtime docs/OperatorKernels.md ('Supported Operators and Data Types', generated from "
                "the registered kernels by tools/python/gen_opkernel_doc.py)",
                "section": "Operators implemented by CUDAExecutionProvider (domains ai.onnx, com.microsoft)",
                "version": f"microsoft/onnxruntime at commit {COMMIT}",
                "address": address,
                "read": READ,
                "note": "The copy stored in the public code index; tag v1.32.0 (the installed onnxruntime) could "
                "not be read. The copy is older than 1.32.0: its CPU section lacks kernels the installed 1.32.0 "
                "registers (e.g. Cast 28, BitShift 28, CumProd 26), and its highest CUDA kernel version is 24.",
            },
        },
        "gaps": [
            "Tag v1.32.0 of docs/OperatorKernels.md was not reachable: CUDA kernels added between commit "
            f"{COMMIT[:8]} and 1.32.0 (schema versions 25..28 and any new ops) are missing; ai.onnx max 24 is the "
            "highest kernel version in the copy read, not ORT 1.32's limit.",
            "IR version: not in OperatorKernels.md; ORT's IR range (see ort-cpu) applies to the hosting runtime.",
            "Types of sequence/optional parameters (Identity/If/Loop 13+ V, Sequence* S, Memcpy*) are not "
            "transcribed; those entries carry no or partial types.",
            "Type constraints are per type parameter, as the document lists them; a combination across parameters "
            "that no single kernel takes can still pass.",
            "ai.onnx min 7 is ORT's stated floor (see ort-cpu notes), not a fact of the document.",
            "Static shapes: the document does not state whether the CUDA EP needs fixed shapes; left out.",
        ],
        "notes": [
            "MemcpyFromHost/MemcpyToHost are the copies ORT inserts between the CUDA EP and the CPU EP, not model ops.",
        ],
    }
    Matrix.model_validate(data)
    return data


def main(argv: list[str] | None = None) -> int:
    """Write ``ort-cuda.yaml`` (default: beside this module) and print a summary line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path(__file__).with_name("ort-cuda.yaml"))
    args = parser.parse_args(argv)
    data = build_matrix()
    header = (
        "# WRITTEN by `python -m onnxdeploy.matrices.transcribe_ort_cuda` from its hand transcription of ORT's\n"
        f"# docs/OperatorKernels.md (CUDA section, commit {COMMIT[:8]}, read {READ}); edit the script, not this file.\n"
    )
    args.output.write_text(header + _dump(data), encoding="utf-8")
    print(f"wrote {args.output}: {len(data['ops'])} op entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
