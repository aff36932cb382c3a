"""Layers the model families are built from: attention and MLP blocks of a decoder layer, linear
layers (fp32 with a measured GEMM choice, tensor-parallel, quantized), mixture of experts,
elementwise ops (RMSNorm, SiLU-and-mul, rotary), rope parameters and the greedy screen of the LM
head. Each op picks its implementation once, when the model is built."""
