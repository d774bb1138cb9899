"""Meshes, logical-axis rules and (later) pipeline schedules and multi-process start-up."""
