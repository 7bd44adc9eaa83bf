"""A user's own torchrun script as a stage or a sweep trial: how the framework launches it, and the runtime helper it calls."""
