"""The run machinery both trainers stand on (flowrl/train for images, flowrl/text for language
models): the run manager's outer loop, run directories, checkpoints and resume, the wall-clock
budget, processes and their shards, producers that sample ahead (on this machine or another),
and the EMA. It knows nothing of images or text: a trainer brings its collect and update."""
