"""The model: its shape (`config`), the network's forward pass (`network`), its weights
(`weights`), and finding or converting a checkpoint (`checkpoint`, with `gguf_convert` for the
embedded GGUF). Importing this package loads nothing; torch loads with `network` and `weights`.
"""
