"""Code both services share: wire protocol, transport, metrics, models and data.

Importing this package does not import TensorFlow; only ``shared.models`` does.
"""
