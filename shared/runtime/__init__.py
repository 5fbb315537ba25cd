"""What every service process runs on: logging, metrics and their catalogue, systemd's
notify protocol, and the compute device.
"""
