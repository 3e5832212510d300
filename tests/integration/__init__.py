"""Tests against real components: the daemon as a subprocess, /dev/shm, torchrun, DataLoader
workers, Lightning, Accelerate, throwaway users."""
