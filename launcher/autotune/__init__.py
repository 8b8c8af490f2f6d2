"""`dslaunch --autotuning tune|run`: find the fastest configuration that fits, and say why.

Pure logic (config section, search space, memory model, tuners, ranking) lives in its own
modules, apart from the process plumbing (trial.py launches one trial as a real
`dslaunch` run of the user's script; driver.py runs the loop and writes the results).
Nothing here imports torch: the launcher's start-up path stays light. The runtime's side
(stop a trial cleanly after end_profile_step, write its metrics) is
dslaunch.runtime.autotuning.
"""
