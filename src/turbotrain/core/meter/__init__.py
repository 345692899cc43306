"""The measuring kit every measuring tool uses: clock, parity (loss-parity rule), cache (decision
cache), table (measured rows as markdown), trial (a step of a copy of the model)."""
