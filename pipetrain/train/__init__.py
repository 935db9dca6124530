"""The trainer: config, data, optimizer, metrics and the loop that drives the runtime.

Modules are imported by path (``pipetrain.train.config``) so that reading a config does
not pay for importing torch.
"""
