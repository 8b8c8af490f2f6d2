"""dslaunch.launcher: the `dslaunch` command: hostfiles, world layout, process supervision.

Nothing on the launcher's start-up path imports torch: a launch must cost milliseconds,
not the seconds torch takes to import.
"""
