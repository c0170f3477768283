import { defineConfig } from 'vitest/config'
export default defineConfig({
  test: {
    projects: [
      {
        test: {
          name: 'unit',
          include: ['tests/**/*.test.ts'],
          exclude: ['tests/runtimes/**', 'tests/template/**', 'tests/connectionConfig.test.ts'],
          isolate: true,
          globals: false,
          testTimeout: 60_000,
          hookTimeout: 60_000,
          environment: 'node',
          bail: 0,
          setupFiles: ['tests/globalFetchFallback.setup.ts'],
          deps: { interopDefault: true },
          env: { ...(process.env as Record<string, string>) },
        },
      },
    ],
  },
})
