"""The model's building blocks: the parallel linears and RMSNorm, the rotary embedding, the
vocabulary embedding and LM head, the weight-only quantized linears, and the Triton ops they use."""
