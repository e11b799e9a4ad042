"""Parallel training layouts composed on one DeviceMesh: data, tensor and pipeline parallel."""
