"""Starting engines and the proxy: processes, health waits, shutdown."""
