"""The suite's XLA flag probe (tests/xla_flags.py): XLA aborts a process on
a flag it does not know, so the suite may only pass flags a probe accepted."""

import os
import secrets

import xla_flags


def test_the_probe_refuses_a_flag_xla_does_not_know():
  name = f"--xla_prefixjax_no_such_flag_{secrets.token_hex(4)}=1"
  assert not xla_flags.accepted(name)


def test_the_suite_passes_only_flags_the_probe_accepts():
  extra = xla_flags.extra()
  assert extra == os.environ[xla_flags.ENV]
  if extra:
    assert xla_flags.accepted(extra)
  assert xla_flags.with_devices(3).split(" ")[0] == (
    "--xla_force_host_platform_device_count=3"
  )
