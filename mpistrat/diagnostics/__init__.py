"""Why a job is slow or stuck: the hot-path monitor (``monitor.py``), who is missing
(``side_channel.py``), the watchdog thread (``watchdog.py``) and its texts (``diagnosis.py``),
stragglers, the flight recorder, the timeline, ending the job when one rank fails (``abort.py``), and a
launch whose tasks MPI did not join into one job (``launch.py``).
"""
