"""Settings: every option declared once, layered from defaults, a TOML file, ``TF_CONFIG``,
``DOWNPOUR_*`` variables and flags.

``settings`` declares options (``Option``) and derives argparse and the config classes from
them; ``forms`` registers the forms one option takes (``--policy``, ``--compress``);
``policy`` is the staleness policies' table of forms and capabilities, read by the server and
by every worker from the hello; ``loading`` layers the sources into one settings object per
service; ``tf_config`` reads a platform's ``TF_CONFIG`` and owns the port convention of a
job's tasks. No TensorFlow.
"""
