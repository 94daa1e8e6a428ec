"""The runner layer, in parts: step_plan (a scheduler step as plain data), step_inputs (staging a
plan's rows for the device), decode_graphs (CUDA graph capture and replay), model_runner (the
forward; owns the KV cache tensor), memory_profile (CUDA start-up measurement)."""
