"""The NKI target (AWS Trainium): the host that converts and launches (host), the kernels no
variant axis changes (kernels), expert-parallel dispatch and combine (a2av), the ops' registration
through torch-neuronx (custom_ops) and the NumPy emulator that runs NKI kernels on CPU (emulator)."""
