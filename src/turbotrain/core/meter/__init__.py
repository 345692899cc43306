"""The measuring kit every measuring tool uses (bench, choose, tune, profile's verify, doctor's
probes, the regime probe, the batch finder, fp8 layer timing): clock (the one step clock and call
timer), parity (the one loss-parity rule), cache (the one decision cache), table (measured rows as
markdown)."""
